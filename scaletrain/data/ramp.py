"""The global batch of each step (`training.batch_ramp = "start:steps"`): a linear ramp from `start` sequences to
the full global batch, in whole multiples of `start` (GPT-3, Brown et al. 2020, grew its batch the same way), and
the learning-rate schedule's position in tokens consumed. Pure arithmetic of the step: a resume needs no state."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from scaletrain.config import parse_batch_ramp

log = logging.getLogger("scaletrain")


@dataclass(frozen=True)
class BatchRamp:
    """Step s (1-based) takes `sequences(s)` sequences of the global stream: `start` at step 1, then the line from
    `start` to `full` rounded down to a multiple of `start` (never above `full`), `full` from step `steps + 1` on.
    `steps = 0`: no ramp, every step takes `full` (what a run without training.batch_ramp does).

    The rungs are multiples of `start`, not of micro_batch x data-parallel ranks: the batch of a step is then the
    same in every layout, so a run resumed on another number of ranks takes the same samples in the same steps as
    the uninterrupted one. validate.py requires `start` (hence every rung) to split into whole micro-batches on
    every data-parallel rank."""

    start: int
    steps: int
    full: int

    @classmethod
    def of(cls, spec: str, full: int) -> BatchRamp:
        """The ramp of `training.batch_ramp` (validated) for a global batch of `full` sequences; "" gives none."""
        start, steps = parse_batch_ramp(spec) if spec else (full, 0)
        return cls(start, steps, full)

    @property
    def on(self) -> bool:
        return self.steps > 0

    def announce(self, spec: str) -> dict:
        """One log line, and what the start event records of the ramp `spec` ({} without a ramp)."""
        if not self.on:
            return {}
        log.info("batch ramp: %d sequences at step 1, growing in steps of %d to %d from step %d; the learning-rate "
                 "schedule counts tokens", self.start, self.start, self.full, self.steps + 1)  # fmt: skip
        return {"batch_ramp": spec}

    def sequences(self, step: int) -> int:
        """The global batch of `step` (1-based), in sequences."""
        if step > self.steps:
            return self.full
        # start + (full - start) * (step - 1) / steps, rounded down to a multiple of start, in integers.
        rungs = (self.start * self.steps + (self.full - self.start) * (step - 1)) // (self.steps * self.start)
        return min(self.full, rungs * self.start)

    @cached_property
    def _ramp_sums(self) -> np.ndarray:
        # _ramp_sums[k]: sequences taken by steps 1..k of the ramp (k <= steps); one pass, then O(1) per query.
        sizes = [self.sequences(s) for s in range(1, self.steps + 1)]
        return np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])

    def consumed(self, step: int) -> int:
        """Sequences taken by steps 1..`step` (0 before the first)."""
        if not self.on:
            return step * self.full
        ramped = min(step, self.steps)
        return int(self._ramp_sums[ramped]) + (step - ramped) * self.full

    def schedule_position(self, index: int) -> float:
        """Where the learning-rate schedule stands for the update with 0-based `index` (step index + 1): the
        sequences consumed before it, in full global batches. Without a ramp, `index` itself; with one, the
        schedule's warmup and decay fall at the same token counts as in a run without it."""
        return self.consumed(index) / self.full

    def schedule_length(self, total_steps: int) -> float:
        """The schedule's length in full global batches: what `total_steps` steps consume. The ramp's steps consume
        less than full ones, so the decay ends on the run's last step (its floor) rather than past the run's end."""
        return self.consumed(total_steps) / self.full


def ramp_problems(
    spec: str, full: int, total_steps: int, micro_batch: int, dp_size: int, pp: int
) -> list[str]:
    """What keeps `training.batch_ramp` from running on this layout, each with the fix."""
    if not spec:
        return []
    try:
        start, steps = parse_batch_ramp(spec)
    except ValueError as e:
        return [str(e)]
    problems = []
    if start > full:
        problems.append(
            f"training.batch_ramp '{spec}': start {start} is above training.global_batch {full} sequences; "
            f"the ramp grows the batch up to the global batch: use a start of at most {full}"
        )
    unit = micro_batch * dp_size
    if start % unit:
        fix = max(1, round(start / unit)) * unit
        problems.append(
            f"training.batch_ramp '{spec}': start {start} sequences do not split into training.micro_batch "
            f"{micro_batch} x {dp_size} data-parallel ranks (every step of the ramp takes a multiple of start); "
            f"use a start of {fix}, or change training.micro_batch"
        )
    if pp > 1:
        problems.append(
            "training.batch_ramp is not supported with parallel.pp > 1: a pipeline schedule runs a fixed number of "
            "micro-batches (parallel.pp_microbatches) every step, so a smaller batch cannot be split; set "
            "parallel.pp = 1 or leave training.batch_ramp empty"
        )
    if steps > total_steps:
        problems.append(
            f"training.batch_ramp '{spec}': the ramp's {steps} steps are more than training.steps {total_steps}; "
            f"the run would never reach its global batch: ramp over at most {total_steps} steps"
        )
    return problems
