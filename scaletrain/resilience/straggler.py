"""Straggler detection: every few steps the ranks share their mean step time, and any rank slower than a multiple of
the median is named (a thermally throttled GPU, a noisy neighbour, a slow NIC or disk slows the whole group)."""

from __future__ import annotations

import math
import statistics
from typing import Any


class StragglerMonitor:
    """Collects this rank's step times; `check` compares them with the other ranks' every `interval` steps.

    What to record matters: in lock-step training every rank waits for the slowest at the gradient collectives, so
    wall-clock step times even out across ranks (the fast ones spend the difference waiting). Record time a rank
    spends on its own work, not waiting on peers: e.g. GPU time of the compute kernels measured with CUDA events
    (NVIDIA's straggler detector does this), or wall time minus time blocked in collectives. The median is the
    reference because it ignores the slow minority it is meant to find (a mean would be pulled toward them).
    """

    def __init__(self, factor: float, interval: int) -> None:
        if factor <= 1 or interval < 1:
            raise ValueError(f"straggler factor must be > 1 and interval >= 1, got {factor} and {interval}")
        self.factor = factor
        self.interval = interval
        self._sum = 0.0
        self._count = 0

    def record(self, step_time_s: float) -> None:
        self._sum += step_time_s
        self._count += 1

    def check(self, step: int, group: Any = None) -> list[dict[str, float]]:
        """At every `interval`-th step, all-gather each rank's mean step time since the last check and return one
        `{"rank", "step_time_s", "median_s", "ratio"}` per rank slower than factor x median (global ranks); other
        steps, and a single process, return [] without communicating.

        Every rank of `group` (None: the default group) must call it at the same steps: it is a collective. A CPU
        tensor is gathered, so pass a gloo group when the default one is NCCL.
        """
        if step % self.interval != 0:
            return []
        mean = self._sum / self._count if self._count else math.nan
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
        # A rank with no steps since the last check (just restarted) has no time to compare: NaN, left out.
        known = [t for t in per_rank if math.isfinite(t)]
        if not known:
            return []
        median = statistics.median(known)
        slow = []
        for i, t in enumerate(per_rank):
            if math.isfinite(t) and median > 0 and t > self.factor * median:
                rank = dist.get_global_rank(group, i) if group is not None else i
                slow.append({"rank": rank, "step_time_s": t, "median_s": median, "ratio": t / median})
        return slow
