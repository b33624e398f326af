"""Device facts, the ground floor the rest of scaletrain reads them from: whether a run uses CUDA (the one place
that asks torch), the GPU table (datasheet peaks per precision, memory, bandwidths) with the one way a device name is
matched to it, the CPUs this process may use and their flags, the one best-of-N timer, and how a process's memory
is accounted: a child process whose peak memory is its own, glibc's allocator returning freed tensors to the kernel
at once (issue 35).

It imports only torch and the standard library, so every layer (metrics, planner, validation, training) may import it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

GiB = 2**30
# What a CPU process holds before the model's first byte (the interpreter, torch's kernels, gloo's connections) where
# this CPU's probe or calibration has not measured it (planning/estimators/memory.cpu_process_bytes): the largest
# measured, so that an unmeasured CPU errs toward refusing. It depends on the CPU and the torch build: 289 MiB a
# forked worker and 365 one process on an AMD EPYC, 372 and 449 on an Intel Xeon with AMX (torch 2.13.0+cpu).
CPU_OVERHEAD_BYTES = 450 * 2**20

# ---------------------------------------------------------------------------------------------------------- CUDA


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (the only call of torch.cuda.is_available in the package)."""
    return torch.cuda.is_available()


def gpu_count() -> int:
    """How many CUDA devices this process sees (the only call of torch.cuda.device_count); 0 without CUDA."""
    return torch.cuda.device_count() if cuda_available() else 0


def uses_cuda(device: str) -> bool:
    """The CUDA rule for a `training.device` / `--device` setting: "cuda" means CUDA (validation refuses it when no
    device is visible), "auto" means CUDA when torch sees one, anything else ("cpu") means the CPU."""
    return device == "cuda" or (device == "auto" and cuda_available())


def sync(device: torch.device | None) -> None:
    """Wait for the work queued on a CUDA `device` (a CUDA call returns at launch); nothing on a CPU."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------------ GPU table


@dataclass(frozen=True)
class GpuSpec:
    """One GPU from its vendor's datasheet. `match`: the case-insensitive substring of torch.cuda.get_device_name()
    that names it. `peak_tflops`: dense (no structured sparsity) peaks per precision: "bf16" the tensor-core rate
    with fp32 accumulation (fp16's is the same on every GPU here), "fp32" plain fp32 on the vector units (not TF32),
    "fp8" where the GPU has it. A GPU without "bf16" (V100) is measured instead. The planner plans the GPUs that have
    a `kind` (its --device name) and the figures after it: memory as the device reports it, HBM TB/s, NVLink GB/s
    (total, both directions, as NVIDIA quotes it), InfiniBand Gb/s per GPU; a GPU with `plans_as` is planned with
    that kind's memory and links but its own peaks."""

    match: str
    peak_tflops: dict[str, float]
    kind: str | None = None
    title: str = ""
    memory_bytes: int = 0
    hbm_tbps: float = 0.0
    nvlink_gbps: float = 0.0
    ib_gbps: float = 0.0
    plans_as: str | None = None

    def peak_flops(self, precision: str) -> float | None:
        """Dense peak FLOP/s at `precision` (fp16 as bf16), None where the datasheet has none."""
        tflops = self.peak_tflops.get("bf16" if precision == "fp16" else precision)
        return None if tflops is None else tflops * 1e12


# Sources. H100 SXM5: NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022) table 3 (the H100 datasheet
# (2023) rounds the same figures: BF16 1,979 with sparsity, FP32 67): BF16 989.4 TFLOPS dense, FP8 1,978.9 dense,
# FP32 66.9; 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s; DGX/HGX H100 pair each GPU with one ConnectX-7 400 Gb/s
# NDR InfiniBand port (DGX H100 datasheet).
# H200 SXM: NVIDIA H200 datasheet (2024): the H100 SXM's Hopper compute, 141 GB HBM3e at 4.8 TB/s, NVLink
# 900 GB/s, 400 Gb/s NDR per GPU in HGX H200. GH200 and H800 SXM: the same Hopper SXM compute.
# A100 SXM4 80GB: NVIDIA A100 datasheet (2021): BF16 312 TFLOPS dense (624 sparse), FP32 19.5, no FP8, 80 GB
# HBM2e at 2,039 GB/s, NVLink 600 GB/s; DGX A100 has one 200 Gb/s HDR InfiniBand port per GPU.
# B200 (HGX, 1,000 W): NVIDIA's GB200 NVL72 / HGX B200 specification table (2024), per GPU: FP16/BF16 4.5 PFLOPS
# sparse (2.25 dense), FP8 9 sparse (4.5 dense), FP32 75 TFLOPS, 180 GB HBM3e usable (192 GB physical); the same
# table's GB200 column (its B200s at 1,200 W): BF16 2.5 dense, FP8 5 dense, FP32 80. DGX B200 datasheet: 64 TB/s
# HBM3e over 8 GPUs (8 TB/s each), NVLink 5 1.8 TB/s, one ConnectX-7 400 Gb/s port per GPU.
# The others (MFU only; no FP8 figure: MFU never asks for one): their vendors' datasheets; A10G has no public
# datasheet and takes the A10's figures.
# Memory in GiB as the device reports it (torch.cuda total_memory): the "80 GB" parts have 80 GiB of HBM (79.6 GiB
# visible), an H200 reports ~140 GiB of its 141 GB, a B200 ~179 GiB.
_HOPPER_SXM = {"bf16": 989.4, "fp8": 1978.9, "fp32": 66.9}
# Matched in order, first match wins: more specific names come first ("GH200" before "H200", "H100 PCIe" before
# "H100", "GB200" before "B200", "A100" before "A10", "L40S" before "L4").
GPU_TABLE: tuple[GpuSpec, ...] = (
    # the B200 of a GB200 at 1,200 W; GB200, GH200 and the other H100s plan with a near kind's memory and links
    GpuSpec("GB200", {"bf16": 2500.0, "fp8": 5000.0, "fp32": 80.0}, plans_as="b200"),
    GpuSpec(
        "B200",
        {"bf16": 2250.0, "fp8": 4500.0, "fp32": 75.0},
        "b200",
        "NVIDIA B200 (HGX)",
        179 * GiB,
        8.0,
        1800,
        400,
    ),
    GpuSpec("GH200", _HOPPER_SXM, plans_as="h200"),
    GpuSpec("H200", _HOPPER_SXM, "h200", "NVIDIA H200 SXM 141GB", 140 * GiB, 4.8, 900, 400),
    GpuSpec("H100 PCIe", {"bf16": 756.0, "fp32": 51.0}, plans_as="h100"),
    GpuSpec("H100 NVL", {"bf16": 835.0, "fp32": 60.0}, plans_as="h100"),
    # SXM, reported as e.g. "NVIDIA H100 80GB HBM3"
    GpuSpec("H100", _HOPPER_SXM, "h100", "NVIDIA H100 SXM5 80GB", 80 * GiB, 3.35, 900, 400),
    GpuSpec("H800 PCIe", {"bf16": 756.0, "fp32": 51.0}),
    GpuSpec("H800", _HOPPER_SXM),
    GpuSpec("H20", {"bf16": 148.0, "fp32": 44.0}),
    GpuSpec(
        "A100", {"bf16": 312.0, "fp32": 19.5}, "a100", "NVIDIA A100 SXM4 80GB", 80 * GiB, 2.039, 600, 200
    ),
    GpuSpec("A800", {"bf16": 312.0, "fp32": 19.5}),
    GpuSpec("A10G", {"bf16": 125.0, "fp32": 31.2}),
    GpuSpec("A10", {"bf16": 125.0, "fp32": 31.2}),
    GpuSpec("L40S", {"bf16": 362.0, "fp32": 91.6}),
    GpuSpec("L40", {"bf16": 181.0, "fp32": 90.5}),
    GpuSpec("L4", {"bf16": 121.0, "fp32": 30.3}),
    GpuSpec("RTX 6000 Ada", {"bf16": 364.0, "fp32": 91.1}),
    GpuSpec("RTX A6000", {"bf16": 155.0, "fp32": 38.7}),
    GpuSpec("RTX 4090", {"bf16": 165.2, "fp32": 82.6}),
    GpuSpec("RTX 3090", {"bf16": 71.0, "fp32": 35.6}),
    GpuSpec("V100", {"fp32": 15.7}),  # SXM2; no bf16 tensor cores
    GpuSpec("MI300X", {"bf16": 1307.4, "fp32": 163.4}),
    GpuSpec("MI250X", {"bf16": 383.0, "fp32": 47.9}),
)
PLANNED_GPUS: dict[str, GpuSpec] = {g.kind: g for g in GPU_TABLE if g.kind}


def match_gpu(name: str) -> GpuSpec | None:
    """The table's entry for a GPU named `name` as torch reports it ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"),
    or None: the only way a device name is matched to the table."""
    lowered = name.lower()
    return next((g for g in GPU_TABLE if g.match.lower() in lowered), None)


def gpu_peak_flops(name: str, precision: str) -> float | None:
    """Datasheet dense peak FLOP/s of the GPU named `name` at `precision`, None when the table does not know it."""
    spec = match_gpu(name)
    return None if spec is None else spec.peak_flops(precision)


# ----------------------------------------------------------------------------------------------------------- CPUs

_CGROUP = Path("/sys/fs/cgroup")


def _quota(cgroup_root: Path) -> float | None:
    """CPUs the cgroup's quota allows (quota / period), None without a quota: cgroup v2's cpu.max ("max 100000" or
    "200000 100000"), else cgroup v1's cpu.cfs_quota_us (-1: none) / cpu.cfs_period_us. Read at the mount root,
    which inside a container is the container's own cgroup."""
    try:
        quota, period = (cgroup_root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for v1 in (cgroup_root / "cpu", cgroup_root / "cpu,cpuacct"):
        try:
            quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
            period_us = int((v1 / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    return None


def usable_cpus(cgroup_root: Path = _CGROUP) -> int:
    """How many CPUs this process can run on: the CPUs of its affinity mask (Slurm's --cpus-per-task, taskset,
    docker --cpuset-cpus), capped by its cgroup's CPU quota (docker --cpus, Kubernetes limits; rounded up: 1.5 CPUs
    of quota keep 2 threads busy part of the time); at least 1. Not os.cpu_count(), which counts every core of the
    machine."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        cpus = os.cpu_count() or 1
    quota = _quota(cgroup_root)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


MEMINFO = "/proc/meminfo"  # the kernel's memory figures (a test points it at a file of its own)


def host_memory_bytes(meminfo: str | None = None, worker: bool | None = None) -> int:
    """Memory this host's processes can have now: the kernel's MemAvailable (free plus reclaimable page cache) where
    it says, never more than the physical memory. Other jobs on a shared host hold the rest, and the kernel's OOM
    killer ends a run that needs it (issue 35: a run accepted against the physical 23.5 GiB was killed while other
    tests held ~2 GiB). `worker` (None: this process is a launched worker, LOCAL_RANK set): the physical memory (a
    started job's own ranks already hold part of it; its launcher checked what was available)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if worker is None:
        worker = "LOCAL_RANK" in os.environ
    if worker:
        return physical
    try:
        text = Path(meminfo or MEMINFO).read_text()
    except OSError:
        return physical
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    available = fields.get("MemAvailable", "").split()
    return min(physical, int(available[0]) * 1024) if available else physical


def cpuinfo_field(key: str, cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The first value of `key` ("flags", "model name") in /proc/cpuinfo, None where it is absent or unreadable."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (empty when /proc/cpuinfo is not readable)."""
    return set((cpuinfo_field("flags", cpuinfo) or "").split())


def cpu_model_name() -> str:
    """The CPU model as /proc/cpuinfo names it, else what `platform` knows."""
    return cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown-cpu"


# A machine whose 1-minute load average is above this share of the usable CPUs is too busy to time: a peak or a
# calibration measured then is too low, and kept, it misstates every later run (issue 24: an MFU of 171%).
BUSY_LOAD_PER_CPU = 0.5


def busy_reason(cpus: int | None = None) -> str | None:
    """Why a timing taken now would be disturbed: the 1-minute load average is above BUSY_LOAD_PER_CPU of the
    `cpus` this process may use (usable_cpus() when None), else None. The load average counts the whole machine (in
    a container too), so a quiet container on a busy host reads as busy: a timing is then kept for one run only,
    never wrong. None where the load average is unknown (no os.getloadavg)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    cpus = usable_cpus() if cpus is None else cpus
    if load > BUSY_LOAD_PER_CPU * cpus:
        return f"load average {load:.2f} > {BUSY_LOAD_PER_CPU:g} x {cpus} usable CPUs"
    return None


def cpu_features() -> str:
    """The CPU and the vector/matrix features that decide its fp32 and bf16 speed (AVX2, AVX-512, AVX512-BF16, AMX),
    as /proc/cpuinfo lists them: what every benchmark prints beside its figures."""
    flags = cpu_flags()
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{cpu_model_name()} ({', '.join(have) or 'none of avx2/avx512/amx'})"


# ---------------------------------------------------------------------------------------------------------- timing


def best_time(
    fn: Callable[[], object],
    budget_s: float = 0.15,
    least: int = 3,
    device: torch.device | None = None,
    before: Callable[[], object] | None = None,
) -> float:
    """Seconds of the fastest of several calls of fn (the run least disturbed by other processes sharing the
    machine): one warm-up call first (kernel selection, allocation, a collective's buffers), then at least `least`
    timed calls and more until `budget_s` has passed. Each call is closed by a synchronisation on a CUDA `device`;
    `before` (a barrier, say) runs ahead of each call, outside the time."""
    fn()
    sync(device)
    best, n, end = float("inf"), 0, time.perf_counter() + budget_s
    while n < least or time.perf_counter() < end:
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
        n += 1
    return best


def run_from_small_parent(cmd: list[str], env: dict, **kw) -> subprocess.CompletedProcess:
    """Run `cmd` as the grandchild of a bare interpreter. Linux folds the parent's peak RSS into a child's
    ru_maxrss across fork and exec, so a run started straight from a process that holds torch would report at least
    that process's memory; a bare interpreter in between (its own peak ~10 MiB) leaves the run's figure its own."""
    hop = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"
    return subprocess.run([sys.executable, "-S", "-c", hop, *cmd], env=env, **kw)


# --------------------------------------------------------------------------------------- glibc's allocator (issue 35)
# On a CPU run, tensors freed go back to the kernel at once, so a worker's resident memory is its live tensors plus
# the interpreter, which is what the memory check counts.

# glibc's mallopt(3) parameter number, and the threshold we pin (its default starting value, 128 KiB).
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 128 * 1024


def pin_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve every allocation of `threshold` bytes or more with its own mmap, unmapped when freed. glibc otherwise
    raises the threshold each time a mapped block is freed (up to 32 MiB), after which a layer's weights, gradients
    and FSDP's buffers come from the heap, whose freed pages stay resident: measured with fsdp over 2 gloo ranks
    (dim 1024, ffn 4096), 1151-1177 MiB peak per rank before, 982 after, the same step time within the machine's
    noise. True if set (glibc only; elsewhere nothing changes)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return bool(libc and libc.mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False
