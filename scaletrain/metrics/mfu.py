"""Model FLOPs utilisation: FLOPs per token, the device's peak FLOP/s, and their ratio.

The peak comes from a config override, a table of GPU datasheet figures, or a timed matmul (cached for CPUs).
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Literal

import torch

from scaletrain.precision.policy import cpu_flags

Precision = Literal["bf16", "fp32"]  # as in TrainingConfig.precision

_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}


def flops_per_token(n_params: int, n_layers: int, dim: int, seq_len: int) -> float:
    """Training FLOPs per token: 6·N + 12·L·d·s (Chowdhery et al. 2022, PaLM, appendix B).

    N: parameters *excluding* the input embedding table (a lookup, not a matmul); the output projection is a
    matmul and stays in N. 6·N is forward (2·N) plus backward (4·N) for every weight matmul. 12·L·d·s covers the
    attention score and value matmuls (QKᵀ and AV) in forward and backward, written as in PaLM: it does not halve
    the count for the causal mask, so MFU stays comparable with PaLM, torchtitan and nanoGPT, which use the same
    formula. Activation recomputation is not counted: MFU counts model FLOPs, not hardware FLOPs.
    """
    return 6.0 * n_params + 12.0 * n_layers * dim * seq_len


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops_total: float) -> float:
    """Fraction of peak reached: achieved model FLOP/s over the summed peak of every process's device."""
    if peak_flops_total <= 0:
        raise ValueError(f"peak_flops_total must be > 0 to compute MFU, got {peak_flops_total}")
    return tokens_per_s * flops_per_token / peak_flops_total


# Dense (no structured sparsity) peak TFLOP/s from the vendors' datasheets and architecture whitepapers.
# "bf16" is the tensor-core rate with fp32 accumulation; "fp32" is plain fp32 on the vector units, not TF32.
# Keys are matched as case-insensitive substrings of torch.cuda.get_device_name() in order, first match wins:
# more specific names come first ("H100 PCIe" before "H100", "A100" before "A10", "L40S" before "L4").
# A GPU without a bf16 entry (V100 has no bf16 tensor cores) is measured instead.
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "B200": {"bf16": 2250.0, "fp32": 75.0},
    "GH200": {"bf16": 989.0, "fp32": 67.0},
    "H200": {"bf16": 989.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.0, "fp32": 60.0},
    "H100": {"bf16": 989.0, "fp32": 67.0},  # SXM, reported as e.g. "NVIDIA H100 80GB HBM3"
    "H800 PCIe": {"bf16": 756.0, "fp32": 51.0},
    "H800": {"bf16": 989.0, "fp32": 67.0},
    "H20": {"bf16": 148.0, "fp32": 44.0},
    "A100": {"bf16": 312.0, "fp32": 19.5},
    "A800": {"bf16": 312.0, "fp32": 19.5},
    "A10G": {"bf16": 125.0, "fp32": 31.2},  # AWS publishes no datasheet; these are the A10's figures
    "A10": {"bf16": 125.0, "fp32": 31.2},
    "L40S": {"bf16": 362.0, "fp32": 91.6},
    "L40": {"bf16": 181.0, "fp32": 90.5},
    "L4": {"bf16": 121.0, "fp32": 30.3},
    "RTX 6000 Ada": {"bf16": 364.0, "fp32": 91.1},
    "RTX A6000": {"bf16": 155.0, "fp32": 38.7},
    "RTX 4090": {"bf16": 165.2, "fp32": 82.6},
    "RTX 3090": {"bf16": 71.0, "fp32": 35.6},
    "V100": {"fp32": 15.7},  # SXM2; no bf16 tensor cores
    "MI300X": {"bf16": 1307.4, "fp32": 163.4},
    "MI250X": {"bf16": 383.0, "fp32": 47.9},
}


def lookup_gpu_peak(name: str, precision: Precision) -> float | None:
    """Datasheet peak in FLOP/s for a GPU name as torch reports it, or None when the table does not know it."""
    lowered = name.lower()
    for key, peaks in GPU_PEAK_TFLOPS.items():
        if key.lower() in lowered:
            tflops = peaks.get(precision)
            return None if tflops is None else tflops * 1e12
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_flops(device: torch.device, precision: Precision, size: int, budget_s: float) -> float:
    """Best FLOP/s of square `size` matmuls on `device`, after one warm-up, repeated for about `budget_s`."""
    dtype = _DTYPES[precision]
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    torch.matmul(a, b)  # warm-up: first call pays for kernel selection and allocation
    _sync(device)
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    repeats = 0
    # Best of several: the fastest run is the one least disturbed by other processes sharing the machine.
    while repeats < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.matmul(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - start)
        repeats += 1
    return 2.0 * size**3 / best  # a size³ matmul is size³ multiply-adds


def measure_cpu_peak(precision: Precision, threads: int, size: int = 1024, budget_s: float = 1.0) -> float:
    """Matmul FLOP/s this process reaches on the CPU with `threads` intra-op threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return measure_matmul_flops(torch.device("cpu"), precision, size, budget_s)
    finally:
        torch.set_num_threads(previous)


def cpu_model_name() -> str:
    """The CPU model as /proc/cpuinfo names it, else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def cpu_features() -> str:
    """The CPU and the vector/matrix features that decide its fp32 and bf16 speed (AVX2, AVX-512, AVX512-BF16, AMX),
    as /proc/cpuinfo lists them: what every benchmark prints beside its figures."""
    flags = cpu_flags()
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{cpu_model_name()} ({', '.join(have) or 'none of avx2/avx512/amx'})"


def _read_cache(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # missing or corrupt: measure again and rewrite it
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, data: dict[str, dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename, so processes measuring at once never read a half-written file.
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def cached_cpu_peak(precision: Precision, threads: int, cache_dir: Path) -> tuple[float, str]:
    """CPU matmul peak for this process, measured once per (CPU model, threads, precision, torch version)."""
    path = cache_dir / "cpu_peak.json"
    cpu = cpu_model_name()
    key = f"{cpu}|threads={threads}|{precision}|torch={torch.__version__}"
    cache = _read_cache(path)
    entry = cache.get(key)
    if isinstance(entry, dict) and isinstance(entry.get("flops"), int | float) and entry["flops"] > 0:
        flops, how = float(entry["flops"]), "read from"
    else:
        flops, how = measure_cpu_peak(precision, threads), "cached in"
        cache[key] = {
            "flops": flops,
            "cpu": cpu,
            "threads": threads,
            "precision": precision,
            "torch": torch.__version__,
            "measured_at": time.time(),
        }
        _write_cache(path, cache)
    source = f"measured CPU matmul {precision} x{threads} threads: {flops / 1e12:.3g} TFLOP/s ({how} {path})"
    return flops, source


def device_peak_flops(
    device: torch.device, precision: Precision, override_tflops: float, cache_dir: Path
) -> tuple[float, str]:
    """Peak FLOP/s of one process's device, and a line saying where the figure came from.

    Order: a configured override (> 0), the GPU table, a timed matmul on an unknown GPU, a cached CPU measurement.
    """
    if precision not in _DTYPES:
        raise ValueError(f"precision must be one of {sorted(_DTYPES)}, got {precision!r}")
    if override_tflops > 0:
        return override_tflops * 1e12, f"configured: metrics.peak_tflops={override_tflops:g}"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = lookup_gpu_peak(name, precision)
        if peak is not None:
            return peak, f"table: {name} {precision} {peak / 1e12:g} TFLOP/s"
        flops = measure_matmul_flops(device, precision, size=8192, budget_s=1.0)
        return flops, (
            f"measured GPU matmul {precision} on {name} (not in the table): {flops / 1e12:.3g} TFLOP/s; "
            "set metrics.peak_tflops to the datasheet figure for a true MFU"
        )
    return cached_cpu_peak(precision, torch.get_num_threads(), cache_dir)
