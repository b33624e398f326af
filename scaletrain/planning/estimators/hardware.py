"""Device profiles for the planner: the GPUs we plan for, from the hardware table (scaletrain/hardware.py) and a CPU
profile measured on this machine by `scaletrain plan --calibrate` (planning/calibrate.py), saved as JSON."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from scaletrain.errors import ConfigError
from scaletrain.hardware import (
    CPU_OVERHEAD_BYTES,
    PLANNED_GPUS,
    GpuSpec,
    cpu_model_name,
    host_memory_bytes,
    match_gpu,
    usable_cpus,
)

GiB = 2**30
GB = 10**9
TB = 10**12
# Measured GEMM throughput, TFLOP/s: the "maximum achievable matmul FLOPS" (MAMF) of torch.matmul, the mean of 100
# timed calls at the best of a brute-force search over shapes, as published in S. Bekman, ml-engineering,
# compute/accelerator/README.md (commit 744d01e, "Maximum Achievable Matmul FLOPS comparison table"): H100 SXM
# bf16 794.5 (80.3% of 989), fp8 1,402.6 (70.9% of 1,979), torch 2.7.0+cu126, "H200 is the same" for bf16; H200
# SXM fp8 1,453.4 (73.4%), torch 2.7.1+cu128; A100 SXM bf16 271.2 (86.9% of 312); B200 SXM bf16 1,745.0 (77.6%),
# fp8 3,432.5 (76.3%). Independent of the published training runs the planner is compared with (docs/planner.md).
# A datasheet profile runs every matmul at its kind's measured rate: an upper bound for the model's own shapes.
MEASURED_MATMUL_TFLOPS: dict[str, dict[str, float]] = {
    "h100": {"bf16": 794.5, "fp8": 1402.6},
    "h200": {"bf16": 794.5, "fp8": 1453.4},
    "a100": {"bf16": 271.2},
    "b200": {"bf16": 1745.0, "fp8": 3432.5},
}
# A precision without a measurement above (fp32 on the vector units): this share of its datasheet peak, a stated
# guess, not a measurement; a calibrated GPU profile (plan --calibrate) replaces it.
ACHIEVABLE_MATMUL = 0.75
# Fraction of HBM bandwidth that element-wise kernels (norms, SwiGLU, RoPE, AdamW) reach: a stated guess (no
# independent measurement of it on Hopper is cited here); a calibrated GPU profile measures AdamW's instead.
ACHIEVABLE_HBM = 0.7
# NCCL's bus bandwidth on NVLink 4 as a share of its 450 GB/s per direction: 8 H200 (the H100's NVLink), 16 GiB,
# nccl-tests ring: all-gather 361.4 GB/s, reduce-scatter 362.9, all-reduce 367.2 (S. Bekman, ml-engineering
# network/README.md at commit 744d01e, section SHARP; NVLS's 480 GB/s all-reduce is left out: FSDP's all-gathers
# and reduce-scatters cannot use it). The planner's collectives are rings, so the all-gather's share.
ACHIEVABLE_NVLINK = 361.4 / 450
# Of a node's NICs: the same source's 4 nodes of 8 H200 with 3.2 Tb/s of EFA each ran a 32-rank all-reduce at 364.9
# GB/s bus bandwidth, 0.91 of 400 GB/s (and at NVLink's ring rate: a lower bound for the NICs).
ACHIEVABLE_NIC = 364.87 / 400


@dataclass
class DeviceProfile:
    """One device and the links between devices, in SI units (FLOP/s, bytes, bytes/s, seconds).

    `matmul`: precision -> (t0 seconds per matmul call, FLOP/s asymptotic rate at `threads` threads): a matmul of F
    FLOPs takes t0 + F / rate (a launch/dispatch latency plus the rate of large shapes), measured on CPUs, the
    published measured GEMM rate on GPUs (MEASURED_MATMUL_TFLOPS). Links: per-rank bandwidth per direction and a
    latency per collective step, inside a node (NVLink / shared memory) and between nodes (InfiniBand / TCP)."""

    name: str
    kind: str  # "gpu" or "cpu"
    peak_flops: dict[
        str, float
    ]  # datasheet dense peak per precision (for MFU), or the measured peak on a CPU
    matmul: dict[str, tuple[float, float]]
    memory_bytes: int
    # bytes/s that element-wise kernels reach (and the optimizer step, where optimizer_bw is 0)
    memory_bw: float
    intra_bw: float
    intra_latency: float
    inter_bw: float
    inter_latency: float
    devices_per_node: int = 8
    overhead_bytes: int = 2 * GiB  # framework overhead per rank: CUDA context, NCCL buffers, allocator slack
    # CPU: the peak RSS of a worker forked from the launcher's warm fork server (`--nproc N`), which counts only the
    # library pages it touches, less than a process that imported everything itself (0: as overhead_bytes).
    worker_overhead_bytes: int = 0
    # CPU: what a process adds when it computes in 16 bits (bf16/fp16, and fp8's bf16): the pages and scratch of the
    # 16-bit kernels (oneDNN's) beyond fp32's, measured by a tiny bf16 run (30 MiB on an Intel Xeon with AMX).
    half_overhead_bytes: int = 0
    # CPU: resident bytes beyond the live tensors per byte of activations (glibc keeps freed activation memory and
    # the backward's transients in its heap; calibrated from two runs with small and large activations; 0 on a GPU,
    # where the allocator's slack is inside overhead_bytes).
    activation_slack: float = 0.0
    op_overhead_s: float = 0.0  # fixed time per block forward+backward (dispatch of its ~40 ops), CPUs only
    step_overhead_s: float = 0.0  # fixed time per optimizer step (loader, clipping, logging), CPUs only
    # Bytes/s of AdamW's pass as training runs it (fused: estimators/time.ADAM_TRAFFIC per parameter), measured by a
    # CPU's probe and calibration; 0 (a GPU, a CPU profile saved before it): memory_bw's. On a CPU the fused kernel
    # runs several times faster than the element-wise kernels memory_bw times, so the two are kept apart.
    optimizer_bw: float = 0.0
    # CPUs only, calibrated from tiny real runs (calibrate.measure_framework): the fixed time of one collective call
    # in a training step (FSDP's copy-in/out and hooks, DTensor dispatch, the ranks' scheduling around it), and
    # per group size ("2", "4", ...: measured with that many processes on the host) where calibration measured it.
    collective_call_s: float = 0.0
    call_by_ranks: dict[str, float] = field(default_factory=dict)
    tp_block_s: float = 0.0  # tensor parallel's fixed cost per block forward+backward (DTensor dispatch)
    sp_block_s: float = (
        0.0  # what sequence parallel adds to that (the norms' and the sequence's redistributions)
    )
    cp_block_s: float = 0.0  # ring attention's fixed cost per block forward+backward
    # What each of those adds per hidden-state element of a micro-batch on a rank (micro x seq / cp x dim), per
    # block: the redistributions' and the ring's copies grow with the activations (issue 35: sp's cost measured 6 ms
    # at dim 64 and 62 ms at dim 256, where a fixed cost fitted at dim 64 charged 18).
    tp_element_s: float = 0.0
    sp_element_s: float = 0.0
    cp_element_s: float = 0.0
    selective_block_s: float = 0.0  # selective recompute's fixed cost per block (its dispatch mode, every op)
    selective_share: float = (
        0.0  # share of the element-wise forward selective recompute re-runs (0: the model's)
    )
    # A cast of fp32 to 16 bits (autocast's, estimators/time.py CAST_BYTES): seconds per call and bytes/s, measured by
    # a CPU's calibration; 0 where not measured (a GPU, a CPU profile saved before it): the memory bandwidth's.
    cast_t0_s: float = 0.0
    cast_bw: float = 0.0
    # A CPU's causal attention (torch's SDPA kernel, forward and backward) per compute dtype ("fp32", "bf16"):
    # (seconds per (sequence, query head) row, FLOP/s), measured by planning/measure.measure_attention; empty where
    # not measured (a GPU: its kernels' published shares), and a dtype not measured takes fp32's, else the GEMM rate.
    attention: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Why the calibration's machine was busy ("" when it was not): its figures are then a share of the cores, and
    # every plan that uses the profile says so (planning/calibrate.busy_reason).
    busy: str = ""
    # A probed CPU (planning/probe.py): what the held-out layout it ran found, and |predicted/measured - 1| there.
    validated: str = ""
    expected_error: float = 0.0
    cores: int = 0  # CPU cores shared by the local processes (0: a GPU, one device per process)
    threads: int = (
        1  # the threads the CPU matmul rate was measured with (the rate scales with min(threads, cores))
    )
    collectives: dict[str, tuple[float, float]] = field(
        default_factory=dict
    )  # calibrated: op -> (latency, bw)
    source: str = "datasheet"

    def process_bytes(self, world_size: int, precision: str = "fp32") -> int:
        """The framework's bytes per rank: a CPU's forked workers (world > 1) pay their own measured figure, and a
        process computing in 16 bits the kernels' pages that fp32 leaves untouched."""
        base = self.worker_overhead_bytes or self.overhead_bytes if world_size > 1 else self.overhead_bytes
        return base + (self.half_overhead_bytes if precision != "fp32" else 0)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> DeviceProfile:
        known = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        data["matmul"] = {k: tuple(v) for k, v in data.get("matmul", {}).items()}
        data["collectives"] = {k: tuple(v) for k, v in data.get("collectives", {}).items()}
        attention = data.get("attention", {})
        # A profile saved before the per-dtype figures held one (seconds per call, FLOP/s), in fp32, whose per-call
        # figure the time model never charged: its rate is kept, with no cost per row, as it was planned.
        if isinstance(attention, list | tuple):
            attention = {"fp32": (0.0, attention[1])} if attention[1] else {}
        data["attention"] = {k: tuple(v) for k, v in attention.items()}
        return cls(**data)


def _measured_matmul(spec: GpuSpec, precision: str, peak: float) -> float:
    """FLOP/s of a GPU's matmuls in `precision` (fp16 as bf16): its kind's measured MAMF scaled by the ratio of this
    GPU's datasheet peak to its kind's (a GPU planned as a near kind, an H100 PCIe, keeps the measured share), else
    ACHIEVABLE_MATMUL of the peak."""
    kind = spec.kind or spec.plans_as or ""
    measured = MEASURED_MATMUL_TFLOPS.get(kind, {}).get("bf16" if precision == "fp16" else precision)
    if measured is None:
        return peak * ACHIEVABLE_MATMUL
    sheet = PLANNED_GPUS[kind].peak_tflops["bf16" if precision == "fp16" else precision] * TB
    return measured * TB * peak / sheet


def _gpu(spec: GpuSpec) -> DeviceProfile:
    """The planner's profile of a GPU of the hardware table: its dense datasheet peaks (the same figures the MFU at
    run time divides by), memory, HBM and link bandwidths, with the stated achievable fractions applied."""
    peaks = {"bf16": spec.peak_tflops["bf16"] * TB, "fp16": spec.peak_tflops["bf16"] * TB}
    peaks.update({p: spec.peak_tflops[p] * TB for p in ("fp32", "fp8") if p in spec.peak_tflops})
    return DeviceProfile(
        name=spec.title,
        kind="gpu",
        peak_flops=peaks,
        # ~5 us per GEMM launch+tail (small-shape GEMMs on Hopper run at a few us), stated as a guess.
        matmul={p: (5e-6, _measured_matmul(spec, p, v)) for p, v in peaks.items()},
        memory_bytes=spec.memory_bytes,
        memory_bw=spec.hbm_tbps * TB * ACHIEVABLE_HBM,
        intra_bw=spec.nvlink_gbps / 2 * GB * ACHIEVABLE_NVLINK,  # per direction
        intra_latency=5e-6,  # NCCL ring step latency over NVLink, ~3-6 us (nccl-tests small messages)
        inter_bw=spec.ib_gbps / 8 * GB * ACHIEVABLE_NIC,
        inter_latency=15e-6,  # IB RDMA step latency through the NCCL proxy, ~10-20 us
    )


# The GPUs the planner knows: those of the hardware table (scaletrain/hardware.py, where each figure's datasheet is
# cited) with memory and link figures, by their --device name (h100, h200, a100, b200).
GPUS: dict[str, DeviceProfile] = {kind: _gpu(PLANNED_GPUS[kind]) for kind in ("h100", "h200", "a100", "b200")}


def gpu_kind(name: str) -> str:
    """The profile kind (h100, ...) of a GPU named `name` as torch reports it, matched as the MFU matches it: its own,
    or the kind it plans as (an H100 PCIe: h100); ConfigError naming the known ones for any other."""
    spec = match_gpu(name)
    kind = spec and (spec.kind or spec.plans_as)
    if kind in GPUS:
        return kind
    raise ConfigError(
        f"the planner has no datasheet profile for '{name}' (it knows "
        f"{', '.join(PLANNED_GPUS[k].match for k in GPUS)}); plan with --device set to the nearest of those, whose "
        "figures are datasheet peaks"
    )


UNCALIBRATED = "uncalibrated defaults: run `scaletrain plan --calibrate` for this machine's figures"
REDO = "rerun `scaletrain plan --calibrate` on a quiet machine (about 5 minutes)"
# The error an uncalibrated CPU plan carries. Step time (issue 24): a held-out 2-rank fsdp layout (6 layers, dim 512,
# seq 256) predicted 2.07x its measured step time on DEFAULT_CPU. Memory (issue 35): the estimate's terms need no
# calibration, but a process's framework bytes depend on the CPU (hardware.CPU_OVERHEAD_BYTES).
UNCALIBRATED_BAND = (
    "uncalibrated: step time may be off by ~2x (memory: on the built-in 450 MiB a process, the largest measured); "
    "run `scaletrain plan --calibrate` (about 5 minutes) for this machine's step times"
)


def profile_caveat(profile: DeviceProfile) -> str | None:
    """The warning a plan on `profile` carries: the uncalibrated CPU default's error band, a probed CPU's measured
    error, or a calibration taken on a busy machine; None for a calibrated quiet CPU and for a GPU's datasheet
    profile (its own table says so)."""
    if profile.kind == "cpu" and profile.source == UNCALIBRATED:
        return UNCALIBRATED_BAND
    if profile.validated:
        under = (
            f" under load ({profile.busy}: measured again when the machine is quiet)" if profile.busy else ""
        )
        return (
            f"probed{under}, not calibrated: step time {profile.validated}; memory counts this CPU's measured "
            f"{profile.process_bytes(1) / 2**20:.0f} MiB a process ({profile.process_bytes(2) / 2**20:.0f} a "
            "worker); `scaletrain plan --calibrate` (about 5 minutes) refines the step time"
        )
    if profile.busy:
        return f"this profile was calibrated under load ({profile.busy}); {REDO}"
    return None


# A CPU until calibrated: a modest figure so that plans run (a calibrated profile replaces every one of these).
DEFAULT_CPU = DeviceProfile(
    name="cpu",
    kind="cpu",
    peak_flops={"fp32": 50e9, "bf16": 50e9},
    matmul={"fp32": (2e-5, 40e9), "bf16": (2e-5, 20e9)},
    memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if hasattr(os, "sysconf")
    else 8 * GiB,
    memory_bw=5e9,
    intra_bw=2e9,
    intra_latency=5e-5,
    inter_bw=1e9,
    inter_latency=1e-4,
    devices_per_node=usable_cpus(),
    overhead_bytes=CPU_OVERHEAD_BYTES,  # the memory check's figure: one definition (issue 35)
    op_overhead_s=1e-3,
    step_overhead_s=5e-3,
    cores=usable_cpus(),
    source=UNCALIBRATED,
)
KINDS = (*GPUS, "cpu")
PROFILE_FILE = "planner_profile.json"
PROBE_FILE = (
    "planner_probe.json"  # a CPU's probe (planning/probe.py), used until `plan --calibrate` saves a profile
)
PROBE_VERSION = 7  # raised when what the probe measures changes: an older cache is measured again


def probe_key() -> dict:
    """What a cached probe is valid for: this CPU model, its usable cores and the torch version."""
    return {
        "cpu": cpu_model_name(),
        "cores": usable_cpus(),
        "torch": torch.__version__,
        "version": PROBE_VERSION,
    }


def cached_probe(cache_dir: Path) -> tuple[DeviceProfile | None, str]:
    """(the probe cached in `cache_dir` for this CPU and torch, None and why there is none)."""
    try:
        saved = json.loads((cache_dir / PROBE_FILE).read_text())
        if saved["key"] != probe_key():
            return None, f"the cached one was measured for {saved['key']}"
        return DeviceProfile.from_json(saved["profile"]), ""
    except FileNotFoundError:
        return None, "none is cached"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"the cached one is unreadable ({type(e).__name__})"


def profile_path(cache_dir: Path, kind: str = "cpu") -> Path:
    """Where the calibrated profile of `kind` lives: one file per kind, so a GPU host's CPU and GPU profiles (and a
    cache shared by several machines) keep each other."""
    return cache_dir / (PROFILE_FILE if kind == "cpu" else f"planner_profile_{kind}.json")


def load_profile(kind: str, cache_dir: Path | None = None) -> DeviceProfile:
    """The profile of `kind` (h100, h200, a100, b200, cpu): the calibrated one in `cache_dir` when it exists and is
    of that kind, else the datasheet (GPUs), or for a CPU its cached probe, else the uncalibrated default.
    ValueError for an unknown kind."""
    kind = kind.lower()
    if kind not in KINDS:
        raise ValueError(f"--device '{kind}' is unknown; choose one of {', '.join(KINDS)}")
    profile = dataclasses.replace(DEFAULT_CPU) if kind == "cpu" else dataclasses.replace(GPUS[kind])
    if cache_dir is not None:
        try:
            saved = DeviceProfile.from_json(json.loads(profile_path(cache_dir, kind).read_text()))
        except (OSError, ValueError, TypeError):
            saved = None
        if saved is not None and saved.kind == profile.kind:
            profile = saved
        elif kind == "cpu":
            profile = cached_probe(cache_dir)[0] or profile
    if kind == "cpu":  # this host, as the memory check sees it: what the kernel has available now (issue 35)
        profile.memory_bytes = host_memory_bytes()
    return profile


def local_gpu_profile(name: str, cache_dir: Path | None = None) -> DeviceProfile:
    """The profile of the local GPU named `name`: its kind's (calibrated, else the datasheet's), and for a GPU that
    plans as a near kind (an H100 PCIe as h100) that profile's memory and links with the GPU's own datasheet peaks,
    the ones the MFU at run time divides by (a datasheet profile's matmul rates follow them)."""
    kind, spec = gpu_kind(name), match_gpu(name)
    profile = load_profile(kind, cache_dir)
    if spec is None or spec.kind == kind:
        return profile
    own = _gpu(dataclasses.replace(PLANNED_GPUS[kind], peak_tflops=spec.peak_tflops))
    calibrated = profile.source != "datasheet"
    return dataclasses.replace(
        profile,
        name=f"{name} (planned with the {kind} profile's memory and links)",
        peak_flops=own.peak_flops,
        matmul=profile.matmul if calibrated else own.matmul,
    )


def save_profile(profile: DeviceProfile, cache_dir: Path, kind: str = "cpu") -> Path:
    path = profile_path(cache_dir, kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(profile.to_json(), indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path
