"""Measurements both calibrations share (a CPU's, plan/calibrate.py, and a GPU host's, plan/calibrate_gpu.py): a
least-squares line, the matmul rate and AdamW's pass over memory."""

from __future__ import annotations

from functools import partial

import torch

from scaletrain.hardware import best_time

SHAPES = (64, 128, 256, 512)  # square matmul sizes: from dispatch-bound to rate-bound


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = a + b·x, intercept clamped at >= 0."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs) or 1.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    return max(my - b * mx, 0.0), b


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


def measure_adam_bandwidth(traffic: int, device: torch.device | None = None, n: int = 2**22) -> float:
    """Bytes/s of AdamW's pass over n fp32 parameters, `traffic` bytes each (the time model's ADAM_TRAFFIC): fused on
    CUDA, foreach on a CPU, as training runs it."""
    p = torch.nn.Parameter(torch.randn(n, device=device))
    p.grad = torch.randn_like(p)
    fused = device is not None and device.type == "cuda"
    opt = torch.optim.AdamW([p], lr=1e-4, fused=fused, foreach=not fused)
    return traffic * p.numel() / best_time(opt.step, budget_s=0.3, device=device)
