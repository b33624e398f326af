"""Model FLOPs utilisation: FLOPs per token, the device's peak FLOP/s, and their ratio.

The peak comes from a config override, the GPU table of scaletrain/hardware.py (the planner's figures too), or a
timed matmul (cached for CPUs while fresh and measured on a quiet machine; dropped when a run exceeds it).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Literal

import torch

from scaletrain.hardware import best_time, busy_reason, cpu_flags, cpu_model_name, gpu_peak_flops, usable_cpus
from scaletrain.models.llama import ModelArgs, layer_window

Precision = Literal["bf16", "fp32"]  # the peak a precision.compute is measured against (mfu_precision)

_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}


def flops_per_token(n_params: int, n_layers: int, dim: int, seq_len: int) -> float:
    """Training FLOPs per token of a causal decoder: 6·N + 6·L·d·s.

    N: parameters *excluding* the input embedding table (a lookup, not a matmul); the output projection is a
    matmul and stays in N. 6·N is forward (2·N) plus backward (4·N) for every weight matmul. Attention's score and
    value matmuls (QKᵀ and AV) cost 2·s·d each per token and layer in forward, three times that with backward:
    12·L·d·s (Chowdhery et al. 2022, PaLM, appendix B; torchtitan and nanoGPT use this too). Our attention is
    causal (SDPA is_causal, FlexAttention's block mask): query i sees i+1 keys, s/2 on average, and the kernels
    skip the masked half, so we count half, 6·L·d·s, as FlashAttention's benchmarks do for causal runs (issue 24:
    the full count made a CPU run report more than its peak). Our MFU is therefore lower than torchtitan's for the
    same run, by (6N + 6Lds) / (6N + 12Lds). Documents and sliding windows mask more; that is not subtracted.
    Activation recomputation is not counted: MFU counts model FLOPs, not hardware FLOPs.
    """
    return 6.0 * n_params + 6.0 * n_layers * dim * seq_len


def attended_keys(seq_len: int, window: int, as_run: bool = False) -> float:
    """The keys a query attends to, averaged over a causal sequence of seq_len: s/2 (the convention above), or
    under a sliding window w < s the band's area over s, w - w²/(2s) (which is s/2 at w = s). as_run: what a
    kernel that computes the whole square computes (GPT-OSS's sink attention, models/attention.sink_attention): s."""
    if as_run:
        return float(seq_len)
    return seq_len / 2 if window <= 0 or window >= seq_len else window - window * window / (2 * seq_len)


def attention_flops_per_token(args: ModelArgs, seq_len: int, as_run: bool = False) -> float:
    """Training FLOPs per token of attention's score and value matmuls over all layers, each layer with its own
    window: 6·(qk width + v width)·keys, forward and backward (12·d·s/2 = 6·d·s per layer for a plain Llama).
    The widths are n_heads·head_dim (head_size apart from dim / n_heads: Qwen3, GPT-OSS); under multi-head latent
    attention qk_nope + qk_rope and v_head_dim per head. Sinks add one term per query and head: not counted."""
    if getattr(args, "mla", False):
        qk = args.n_heads * (args.qk_nope_head_dim + args.qk_rope_head_dim)
        v = args.n_heads * args.v_head_dim
    else:
        qk = v = args.n_heads * args.head_dim
    sinks = as_run and args.attention_sinks
    # The multi-token prediction module's block (model.mtp_depth, DeepSeek-V3) attends like one more layer.
    layers = args.n_layers + getattr(args, "mtp_depth", 0)
    keys = sum(attended_keys(seq_len, layer_window(args, i), sinks) for i in range(layers))
    return 6.0 * (qk + v) * keys


def model_flops_per_token(n_params: int, args: ModelArgs, seq_len: int) -> float:
    """flops_per_token for the model as it is built: 6·N plus its attention (attention_flops_per_token): equal
    to flops_per_token for a Llama, less under sliding windows, per head size and MLA's widths."""
    return 6.0 * n_params + attention_flops_per_token(args, seq_len)


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


# A cached CPU peak is measured again after this long: nothing else would ever correct a figure measured while
# something unnoticed ran (one re-measurement a month costs a second).
CPU_PEAK_MAX_AGE_S = 30 * 86400


def _cpu_peak_key(precision: Precision, threads: int) -> str:
    """What a CPU peak depends on: the CPU and its matmul features, the CPUs this process may use (a cgroup quota
    or affinity mask shares them), the threads, the precision and the torch version (its kernels)."""
    features = ",".join(sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}))
    where = f"{cpu_model_name()}|{features}|cpus={usable_cpus()}"
    return f"{where}|threads={threads}|{precision}|torch={torch.__version__}"


def _fresh(entry: object) -> bool:
    """A cache entry to trust: a positive figure, measured less than CPU_PEAK_MAX_AGE_S ago on a quiet machine."""
    if not isinstance(entry, dict) or not isinstance(entry.get("flops"), int | float) or entry["flops"] <= 0:
        return False
    measured_at = entry.get("measured_at")
    return isinstance(measured_at, int | float) and 0 <= time.time() - measured_at < CPU_PEAK_MAX_AGE_S


def cached_cpu_peak(precision: Precision, threads: int, cache_dir: Path) -> tuple[float, str]:
    """CPU matmul peak for this process: read from the cache when fresh (_fresh, _cpu_peak_key), else measured.
    A peak measured while the machine is busy (hardware.busy_reason) is used for this run and not cached."""
    path = cache_dir / "cpu_peak.json"
    key = _cpu_peak_key(precision, threads)
    cache = _read_cache(path)
    entry = cache.get(key)
    busy = None
    if _fresh(entry):
        flops, how = float(entry["flops"]), f"read from {path}"
    else:
        busy = busy_reason()
        flops = measure_cpu_peak(precision, threads)
        if busy is None:
            how = f"cached in {path}"
            cache[key] = {
                "flops": flops,
                "cpu": cpu_model_name(),
                "usable_cpus": usable_cpus(),
                "threads": threads,
                "precision": precision,
                "torch": torch.__version__,
                "measured_at": time.time(),
            }
            _write_cache(path, cache)
        else:
            how = f"measured under load, {busy}: this run only, not cached"
    source = f"measured CPU matmul {precision} x{threads} threads: {flops / 1e12:.3g} TFLOP/s ({how})"
    return flops, source


def forget_cpu_peak(precision: Precision, threads: int, cache_dir: Path) -> bool:
    """Drop this process's cached CPU peak (a run exceeded it), so the next run measures again; whether one was."""
    path = cache_dir / "cpu_peak.json"
    cache = _read_cache(path)
    if cache.pop(_cpu_peak_key(precision, threads), None) is None:
        return False
    _write_cache(path, cache)
    return True


def over_peak_action(
    event: Callable[..., None],
    device: torch.device,
    precision: Precision,
    override_tflops: float,
    cache_dir: Path,
) -> Callable[[float], None]:
    """What a run does when its MFU goes above 100% (StepMeter's on_over_peak): an `mfu_over_peak` event, and a
    measured CPU peak dropped from the cache so that the next run measures it again. The peak is not measured again
    inside the run: every rank of a CPU run would time its matmuls at once, each under the others' load."""

    def act(value: float) -> None:
        forgotten = False
        if device.type == "cpu" and override_tflops <= 0:
            forgotten = forget_cpu_peak(precision, torch.get_num_threads(), cache_dir)
        event("mfu_over_peak", mfu=value, cached_peak_dropped=forgotten)

    return act


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
