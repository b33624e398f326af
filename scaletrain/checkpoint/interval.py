"""The checkpoint interval that minimises expected lost time (Young 1974; Daly 2006): tau = sqrt(2 * delta * MTBF),
with delta the time a save blocks training and MTBF the mean time between failures. Every rank must choose the same
interval, so the figures it comes from are agreed first (slowest_rank)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def young_daly_interval_s(delta_s: float, mtbf_s: float) -> float:
    return math.sqrt(2.0 * max(delta_s, 1e-6) * mtbf_s)


def interval_steps(delta_s: float, mtbf_s: float, step_time_s: float) -> int:
    """The Young/Daly interval in whole steps (at least 1)."""
    return max(1, round(young_daly_interval_s(delta_s, mtbf_s) / max(step_time_s, 1e-9)))


def slowest_rank(figures: list[float], group: dist.ProcessGroup | None) -> list[float]:
    """Each figure's maximum over the ranks of a CPU (gloo) group, the same list on every rank (the figures
    themselves for None). A save is collective, so the job's save costs what its slowest rank's does, and its
    step lasts as long as its slowest rank's."""
    if group is None:
        return figures
    t = torch.tensor(figures, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()
