"""Training-health checks the loop consults every step: a non-finite loss or gradient norm (skip the update, then
roll back) and loss spikes against a running mean and standard deviation (roll back and skip the batches, PaLM)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import Any, Literal, Protocol

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

    def state_dict(self) -> dict[str, int]:
        return {"streak": self.streak, "skipped_total": self.skipped_total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak = int(state["streak"])
        self.skipped_total = int(state["skipped_total"])


class SpikeDetector:
    """Flags a loss that exceeds the running mean by `zscore` running standard deviations.

    PaLM (Chowdhery et al. 2022, section 5.1) saw about 20 loss spikes in its largest run and recovered from each by
    restarting from a checkpoint ~100 steps earlier and skipping the ~200-500 batches around the spike; they found
    the spikes came from a bad pairing of batch and model state, not bad data alone. This detector names the step;
    the caller rolls back and skips. The statistics cover only the last `window` non-spike losses, so a spike does
    not inflate the very mean and deviation it is judged against.
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

    def state_dict(self) -> dict[str, Any]:
        """Plain floats and lists, so a checkpoint or an in-memory snapshot can carry it."""
        return {"window": self.window, "zscore": self.zscore, "losses": list(self._losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._losses = deque((float(x) for x in state["losses"]), maxlen=self.window)


class _HasZeroGrad(Protocol):
    def zero_grad(self, set_to_none: bool = ...) -> None: ...


def skip_update(optimizers: Iterable[_HasZeroGrad]) -> None:
    """Drop this step's gradients without stepping: the weights and optimizer moments stay as they were.

    `set_to_none` frees the gradient memory and makes the next backward write fresh gradients instead of adding to
    the bad ones. The LR schedule is the caller's choice (stepping it keeps the schedule aligned to the step count).
    """
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
