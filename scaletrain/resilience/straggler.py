"""Straggler detection: every few steps the ranks share their mean busy time per step (their own work, not time
spent waiting for peers), and any rank slower than a multiple of the other ranks' median is named (a thermally
throttled GPU, a slow host or disk slows the whole group)."""

from __future__ import annotations

import math
import statistics
from typing import Any


class StragglerMonitor:
    """Collects this rank's busy time per step; `check` compares it with the other ranks' every `interval` steps.

    What to record matters: in lock-step training every rank waits for the slowest at the gradient collectives, so
    wall-clock step times even out across ranks (the fast ones spend the difference waiting). Record time a rank
    spends on its own work, not waiting on peers: resilience/busy.py gives CPU time on CPU and the device time of
    the step's compute (CUDA events) on a GPU. The median of the
    other ranks is the reference because it ignores the slow minority it is meant to find (a mean would be pulled
    toward them), and with two ranks it is simply the peer.
    """

    def __init__(self, factor: float, interval: int) -> None:
        if factor <= 1 or interval < 1:
            raise ValueError(f"straggler factor must be > 1 and interval >= 1, got {factor} and {interval}")
        self.factor = factor
        self.interval = interval
        self._sum = 0.0
        self._count = 0

    def record(self, busy_s: float) -> None:
        self._sum += busy_s
        self._count += 1

    def check(self, step: int, group: Any = None) -> list[dict[str, float]]:
        """At every `interval`-th step, all-gather each rank's mean busy time since the last check and return one
        `{"rank", "busy_s", "median_s", "ratio"}` per rank slower than factor x the median of the other ranks
        (global ranks); other steps, and a single process, return [] without communicating.

        Every rank of `group` (None: the default group) must call it at the same steps: it is a collective. A CPU
        tensor is gathered, so pass a gloo group when the default one is NCCL.
        """
        if step % self.interval != 0:
            return []
        mean = self.mean()
        self._sum, self._count = 0.0, 0
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return []
        import torch

        # float64: step times of microseconds and of minutes side by side, no rounding worth a thought.
        mine = torch.tensor([mean], dtype=torch.float64)
        times = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(times, mine, group=group)
        per_rank = [t.item() for t in times]
        return [
            {**s, "rank": dist.get_global_rank(group, s["rank"]) if group is not None else s["rank"]}
            for s in slow_ranks(per_rank, self.factor)
        ]

    def mean(self) -> float:
        """This rank's mean busy seconds per step since the last check (NaN before any step)."""
        return self._sum / self._count if self._count else math.nan


def slow_ranks(per_rank: list[float], factor: float) -> list[dict[str, float]]:
    """One `{"rank", "busy_s", "median_s", "ratio"}` per position of `per_rank` (mean busy seconds per step, one per
    rank) slower than `factor` x the median of the others. A rank with no steps since the last check (just
    restarted) has no time to compare: NaN, left out."""
    slow = []
    for i, t in enumerate(per_rank):
        # The median of the OTHER ranks: with many ranks it is the median, and with two it is the peer (the
        # median of both could never be exceeded by a factor of 2 or more).
        others = [x for j, x in enumerate(per_rank) if j != i and math.isfinite(x)]
        if not others or not math.isfinite(t):
            continue
        median = statistics.median(others)
        if median > 0 and t > factor * median:
            slow.append({"rank": i, "busy_s": t, "median_s": median, "ratio": t / median})
    return slow
