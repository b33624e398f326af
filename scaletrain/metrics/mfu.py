"""Model FLOPs utilisation: FLOPs per token, the device's peak FLOP/s, and their ratio.

The peak comes from a config override, the GPU table of scaletrain/hardware.py (the planner's figures too), or a
timed matmul (cached for CPUs).
"""

from __future__ import annotations

import json
import os
import time
from functools import partial
from pathlib import Path
from typing import Literal

import torch

from scaletrain.hardware import best_time, cpu_model_name, gpu_peak_flops

Precision = Literal["bf16", "fp32"]  # the peak a precision.compute is measured against (mfu_precision)

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


def measure_matmul_flops(device: torch.device, precision: Precision, size: int, budget_s: float) -> float:
    """Best FLOP/s of square `size` matmuls on `device`, after one warm-up, repeated for about `budget_s`."""
    dtype = _DTYPES[precision]
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    best = best_time(partial(torch.matmul, a, b), budget_s, least=3, device=device)
    return 2.0 * size**3 / best  # a size³ matmul is size³ multiply-adds


def measure_cpu_peak(precision: Precision, threads: int, size: int = 1024, budget_s: float = 1.0) -> float:
    """Matmul FLOP/s this process reaches on the CPU with `threads` intra-op threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return measure_matmul_flops(torch.device("cpu"), precision, size, budget_s)
    finally:
        torch.set_num_threads(previous)


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
        peak = gpu_peak_flops(name, precision)
        if peak is not None:
            return peak, f"table: {name} {precision} {peak / 1e12:g} TFLOP/s"
        flops = measure_matmul_flops(device, precision, size=8192, budget_s=1.0)
        return flops, (
            f"measured GPU matmul {precision} on {name} (not in the table): {flops / 1e12:.3g} TFLOP/s; "
            "set metrics.peak_tflops to the datasheet figure for a true MFU"
        )
    return cached_cpu_peak(precision, torch.get_num_threads(), cache_dir)
