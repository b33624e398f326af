"""Training-health checks the loop consults every step: a non-finite loss or gradient norm (skip the update, then
roll back) and loss spikes against a running mean and standard deviation (roll back and skip the batches, PaLM)."""

from __future__ import annotations

import math
from collections import deque
from typing import Literal

Decision = Literal["ok", "skip", "rollback"]


class NanGuard:
    """Decides what to do with a step whose loss or gradient norm is NaN/Inf.

    One bad step is skipped: its gradients are dropped and the optimizer does not step, so the weights and the Adam
    moments stay finite (an update from a NaN gradient would poison every later step). A run of `rollback_after`
    bad steps in a row means the weights or optimizer state themselves went bad, which skipping cannot cure: the
    caller then restores the newest snapshot. `rollback_after <= 0` never asks for a rollback.
    """

    def __init__(self, rollback_after: int) -> None:
        self.rollback_after = rollback_after
        self.streak = 0
        """Non-finite steps in a row, ending with the latest one."""
        self.skipped_total = 0
        """Updates not applied because of a non-finite loss or gradient norm (the rollback step included)."""

    def check(self, loss: float, grad_norm: float) -> Decision:
        """ "ok", "skip" (zero the gradients, do not step) or "rollback" (restore the newest snapshot).

        Pass the gradient norm after the all-reduce (what `StepRunner.clip` returns): it is the same on every rank,
        so all ranks take the same decision. Passing 0-d tensors works too; `float()` syncs with the device once.
        """
        if math.isfinite(float(loss)) and math.isfinite(float(grad_norm)):
            self.streak = 0
            return "ok"
        self.streak += 1
        self.skipped_total += 1
        if self.rollback_after > 0 and self.streak >= self.rollback_after:
            self.streak = 0  # the rollback restores a healthy state: the next bad step starts a new streak
            return "rollback"
        return "skip"


class SpikeDetector:
    """Flags a loss that exceeds the running mean by `zscore` running standard deviations.

    PaLM (Chowdhery et al. 2022, section 5.1) saw about 20 loss spikes in its largest run and recovered from each by
    restarting from a checkpoint ~100 steps earlier and skipping the ~200-500 batches around the spike; they found
    the spikes came from a bad pairing of batch and model state, not bad data alone. This detector names the step;
    the caller rolls back and skips. The statistics cover only the last `window` non-spike losses, so a spike does
    not inflate the very mean and deviation it is judged against.

    Neither detector is checkpointed (they have no state_dict): after a restart the spike window fills again
    (min(window, 10) steps unjudged) and the non-finite streak starts at zero, which a restored healthy state
    justifies; the totals of skipped steps live in events.jsonl.
    """

    def __init__(self, window: int, zscore: float) -> None:
        if window < 2:
            raise ValueError(f"spike window must be at least 2 losses, got {window}")
        self.window = window
        self.zscore = zscore
        # Early losses fall by whole nats in a few steps and a standard deviation of a handful of points is noise:
        # judge nothing until min(window, 10) losses are in.
        self.min_history = min(window, 10)
        self._losses: deque[float] = deque(maxlen=window)

    @property
    def mean(self) -> float:
        """Mean of the losses in the window (NaN while it is empty)."""
        return sum(self._losses) / len(self._losses) if self._losses else math.nan

    @property
    def std(self) -> float:
        """Sample standard deviation of the losses in the window (NaN with fewer than two)."""
        n = len(self._losses)
        if n < 2:
            return math.nan
        m = self.mean
        return math.sqrt(sum((x - m) ** 2 for x in self._losses) / (n - 1))

    def observe(self, loss: float) -> bool:
        """True when `loss` is a spike; otherwise it joins the running statistics.

        Observe the loss averaged over data-parallel ranks so that every rank sees the same value and decides alike.
        A non-finite loss is left to `NanGuard`: it returns False and is not recorded.
        """
        loss = float(loss)
        if not math.isfinite(loss):
            return False
        if len(self._losses) >= self.min_history:
            mean = self.mean
            # A floor on the deviation: a perfectly flat loss (e.g. a tiny deterministic test) would otherwise
            # call any rounding-level rise an infinite z-score.
            std = max(self.std, 1e-6 * abs(mean), 1e-12)
            if loss > mean + self.zscore * std:
                return True
        self._losses.append(loss)
        return False
