"""Measurements both calibrations share (a CPU's, calibrate.py, and a GPU host's, calibrate_gpu.py): a
least-squares line, the matmul rate and AdamW's pass over memory; a CPU's autocast casts; local ranks to time."""

from __future__ import annotations

import json
import socket
import statistics
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from scaletrain.hardware import best_time

SHAPES = (64, 128, 256, 512)  # square matmul sizes: from dispatch-bound to rate-bound


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = a + b·x, intercept clamped at >= 0."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs) or 1.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    return max(my - b * mx, 0.0), b


def run_ranks(rank_fn: Callable, nproc: int, *args) -> object:
    """Run rank_fn(rank, nproc, port, *args, out) in nproc freshly spawned local processes (gloo's rendezvous on a
    free loopback port) and return the JSON rank 0 wrote to the file `out`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "result")
        mp.start_processes(rank_fn, args=(nproc, port, *args, out), nprocs=nproc, start_method="spawn")
        return json.loads(Path(out).read_text())


def fit_line_robust(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Theil-Sen (intercept, slope) of y = a + b·x: the median of the pairwise slopes, then the median of y - b·x,
    intercept clamped at >= 0. One disturbed timing among five moves it little, where least squares can put the
    intercept below 0 (issue 35: a block's fixed cost fitted as 0 on a loaded host)."""
    pairs = [
        (ys[j] - ys[i]) / (xs[j] - xs[i])
        for i in range(len(xs))
        for j in range(i + 1, len(xs))
        if xs[j] != xs[i]
    ]
    b = statistics.median(pairs) if pairs else 0.0
    return max(statistics.median(y - b * x for x, y in zip(xs, ys)), 0.0), b


def measure_matmul(
    dtype: torch.dtype, device: torch.device | None = None, shapes: tuple[int, ...] = SHAPES
) -> tuple[float, float]:
    """(t0 seconds per call, FLOP/s) fitted to time = t0 + flops / rate over square matmuls of `shapes`."""
    flops, times = [], []
    for n in shapes:
        a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
        flops.append(2.0 * n**3)
        times.append(best_time(partial(torch.mm, a, b), device=device))
    t0, slope = fit_line(flops, times)
    return t0, 1.0 / max(slope, 1e-18)


# Linear shapes (tokens, in, out) from the debug model's to a 30M-class model's: the autocast casts of each.
CAST_SHAPES = ((256, 128, 128), (256, 128, 352), (512, 256, 256), (256, 512, 512))


def measure_cast(shapes: tuple[tuple[int, int, int], ...] = CAST_SHAPES) -> tuple[float, float]:
    """(seconds per cast call, bytes/s) of autocast's casts on this CPU: what an fp32 Linear under bf16 autocast
    takes beyond the same Linear on bf16 tensors (its weight's and input's casts, and whatever per-call work
    autocast adds), fitted to 2 t0 + bytes / bw with 6 bytes per element cast (read 4, write 2). Slope 0 (noise):
    bandwidth 0, the profile's memory bandwidth in its place (estimators/time.cast_rate)."""
    xs, ys = [], []
    for m, k, n in shapes:
        linear, x = torch.nn.Linear(k, n, bias=False), torch.randn(m, k)
        xb, wb = x.bfloat16(), linear.weight.detach().bfloat16()
        xs.append(6.0 * (k * n + m * k))
        ys.append(
            max(best_time(partial(_autocast_linear, linear, x)) - best_time(partial(F.linear, xb, wb)), 0)
        )
    a, b = fit_line(xs, ys)
    return a / 2, (1.0 / b if b > 0 else 0.0)


def _autocast_linear(linear: torch.nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        linear(x)


def measure_adam_bandwidth(traffic: int, device: torch.device | None = None, n: int = 2**22) -> float:
    """Bytes/s of AdamW's pass over n fp32 parameters, `traffic` bytes each (the time model's ADAM_TRAFFIC), as
    training runs it (optim/optimizers.adamw_implementation: fused)."""
    p = torch.nn.Parameter(torch.randn(n, device=device))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    return traffic * p.numel() / best_time(opt.step, budget_s=0.3, device=device)


# Attention shapes (batch, sequence, head_dim) of a CPU's causal SDPA, ATTENTION_HEADS query and half as many
# key/value heads: the debug model's head and a 30M-class model's, at the lengths and micro-batches the planner's CPU
# layouts train. Batches of 1 and 4 at the same length separate the cost of a (sequence, head) row from the FLOPs'.
ATTENTION_SHAPES = ((1, 128, 32), (4, 128, 32), (1, 512, 32), (1, 256, 64), (4, 128, 64), (1, 1024, 64))
ATTENTION_HEADS = 4


def attention_flops(seq: int, width: int) -> float:
    """Forward FLOPs of causal attention over `seq` tokens of `width` query channels as the time model counts them
    (estimators/time._matmuls): QKᵀ and AV, each 2·seq·(seq/2)·width."""
    return 2 * (2 * seq * (seq / 2) * width)


def measure_attention(
    dtype: torch.dtype = torch.float32, shapes: tuple[tuple[int, int, int], ...] = ATTENTION_SHAPES
) -> tuple[float, float]:
    """(seconds per (sequence, query head) row, FLOP/s) of causal SDPA's forward and backward in `dtype` on this CPU,
    fitted to rows x c + 3 x forward FLOPs / rate (backward charged twice forward, as the time model charges it).
    torch's CPU flash kernel runs far below the GEMM rate (10-20 GFLOP/s per thread at short lengths against ~100
    for the matmuls of the same model; issue 35: the debug model at seq 256 spent 126 ms a step in it against 15 ms
    predicted), and in bf16 each row costs more again: on an Intel Xeon with AMX a [4, 4, 128, 64] call took 5.0 ms
    in bf16 against 2.2 in fp32, and a bf16 d256 step spent 39 ms of its 195 in attention, 8 charged before."""
    rows, flops, ys = [], [], []
    for batch, seq, dim in shapes:
        q = torch.randn(batch, ATTENTION_HEADS, seq, dim, dtype=dtype, requires_grad=True)
        k, v = (
            torch.randn(batch, ATTENTION_HEADS // 2, seq, dim, dtype=dtype, requires_grad=True) for _ in "kv"
        )
        rows.append(batch * ATTENTION_HEADS)
        flops.append(batch * 3 * attention_flops(seq, ATTENTION_HEADS * dim))
        ys.append(best_time(partial(_attention_step, q, k, v)))
    per_row, per_flop = fit_plane(rows, flops, ys)
    return per_row, 1.0 / max(per_flop, 1e-18)


def fit_plane(x1: list[float], x2: list[float], ys: list[float]) -> tuple[float, float]:
    """(a, b) >= 0 of y = a·x1 + b·x2 through the origin, least squares in relative error (each point weighted by
    1/y: a short call counts as much as a long one); a clamped at 0 and b refitted alone when it would go below."""
    y = torch.tensor(ys, dtype=torch.float64)
    design = torch.tensor([x1, x2], dtype=torch.float64).T / y[:, None]
    ones = torch.ones(len(ys), 1, dtype=torch.float64)
    a, b = torch.linalg.lstsq(design, ones).solution.flatten().tolist()
    if a <= 0:
        return 0.0, torch.linalg.lstsq(design[:, 1:], ones).solution.item()
    return a, max(b, 0.0)


def _attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
