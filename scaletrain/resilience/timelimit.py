"""Bounded jobs: `run.stop_at_step` ends a start at that step of the configured schedule, `run.time_limit` ends it
while there is still time to save, both with a committed checkpoint, so that a job runs in several allocations
with the learning-rate schedule of one. The ranks agree on the time limit over the CPU control group, as on SIGTERM.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch.distributed as dist

from scaletrain.config import RunConfig
from scaletrain.errors import UserError
from scaletrain.parallel.mesh import any_rank

log = logging.getLogger("scaletrain")

JOB_START_ENV = "SCALETRAIN_JOB_START"
"""Unix seconds when the allocation's job started: the launcher (`scaletrain train --nproc`) sets it for its workers
and every restart of them; a job script may export it for a torchrun it starts itself (examples/slurm)."""
_IMPORTED_AT = time.time()
MARGIN_S = 5.0
"""Kept free beyond one more step and the final save: the process exit and clocks that differ between hosts."""
STEP_WINDOW = (
    20  # the longest of the last this-many steps is what one more step may cost (eval steps are longer)
)
DURATION_FORMS = '"90s", "45m", "2h", "3h50m", "1h30m15s", or a number of seconds'
_DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?")


def parse_duration(text: str) -> float:
    """Seconds in "3h50m", "90s", "2h", "1h30m15s" or "5400"; raises ValueError naming the accepted forms."""
    s = text.strip().lower()
    try:
        seconds = float(s)
    except ValueError:
        m = _DURATION.fullmatch(s)
        if not s or m is None:
            raise ValueError(f"run.time_limit {text!r} is not a duration; use {DURATION_FORMS}") from None
        h, mins, secs = m.groups()
        seconds = int(h or 0) * 3600 + int(mins or 0) * 60 + float(secs or 0)
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"run.time_limit {text!r} must be a positive duration; use {DURATION_FORMS}")
    return seconds


def limit_problems(run: RunConfig, steps: int, checkpoints: bool) -> list[str]:
    """What is wrong with run.time_limit and run.stop_at_step, each with its fix."""
    problems = []
    if run.time_limit:
        try:
            parse_duration(run.time_limit)
        except ValueError as e:
            problems.append(str(e))
    if run.stop_at_step < 0:
        problems.append(f"run.stop_at_step must be >= 0 (0: off), got {run.stop_at_step}")
    elif run.stop_at_step > max(steps, 0):
        problems.append(
            f"run.stop_at_step {run.stop_at_step} is past training.steps {steps}: the run ends at step {steps} "
            f"anyway; use a step <= {steps}, or 0"
        )
    if (run.time_limit or run.stop_at_step) and not checkpoints:
        problems.append(
            "run.time_limit and run.stop_at_step stop a job to continue it later from its checkpoint: they need "
            "checkpoint.enabled = true"
        )
    return problems


def job_start() -> float:
    """When this allocation's job started (Unix seconds): $SCALETRAIN_JOB_START, else this process's start."""
    raw = os.environ.get(JOB_START_ENV, "")
    if not raw:
        return process_start()
    try:
        return float(raw)
    except ValueError:
        raise UserError(
            f"${JOB_START_ENV} is {raw!r}; it must be Unix seconds (e.g. export {JOB_START_ENV}=$(date +%s))"
        ) from None


def process_start() -> float:
    """This process's start (Unix seconds) from /proc; where there is none, when it imported this module (after
    its imports: a few seconds late)."""
    try:
        # Field 22 of /proc/self/stat: the start in clock ticks after boot; the fields after the ")" ending the name.
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT
    # The age on the boot clock, subtracted from now: /proc/stat's btime is the wall clock at boot, and a wall clock
    # stepped since (NTP, a VM restored from a snapshot) put btime + ticks 26 s in the future in CI.
    age = max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    return time.time() - age


class JobLimits:
    """run.stop_at_step and run.time_limit for one start of the job. The time limit stops after the step where
    elapsed + one more step + the final save + MARGIN_S would pass the limit; every start makes at least one step,
    so a requeued job always gets on. Time comes from `clock` (Unix seconds; a test injects one) and the local
    decisions are agreed with `agree` (by default any_rank over the CPU group: one rank's late clock stops all)."""

    def __init__(
        self,
        run: RunConfig,
        steps: int,
        group: dist.ProcessGroup | None,
        event: Callable[..., None] = lambda *a, **k: None,
        *,
        start_s: float | None = None,
        clock: Callable[[], float] = time.time,
        agree: Callable[[bool], bool] | None = None,
    ) -> None:
        self.steps, self.stop_at_step = steps, run.stop_at_step
        self.limit_text, self.limit_s = (
            run.time_limit,
            parse_duration(run.time_limit) if run.time_limit else 0.0,
        )
        self.start_s = job_start() if start_s is None else start_s
        self.clock, self.event = clock, event
        self.agree = agree or partial(any_rank, group=group)
        self.step_times: deque[float] = deque(maxlen=STEP_WINDOW)
        self._last: float | None = None
        self.reason: str | None = None
        self.dry: dict | None = None  # data.when_dry = "stop": the source read to its end

    def begin(self, step: int) -> int:
        """Called before this start's first step: step times are measured from now on. Returns the step this
        start trains up to: run.stop_at_step when set, else training.steps."""
        self._last = self.clock()
        if self.stop_at_step and step >= self.stop_at_step:
            log.warning(
                "run.stop_at_step %d: the run is already at step %d, nothing to train",
                self.stop_at_step,
                step,
            )
        return self.stop_at_step or self.steps

    def due(self, save_s: float) -> bool:
        """This rank's view: stop now, since one more step and the final save (`save_s`, the longest measured so
        far) would not fit in the time left. Records the step that just ended."""
        now = self.clock()
        if self._last is not None:
            self.step_times.append(now - self._last)
        self._last = now
        step_s = max(self.step_times, default=0.0)
        return now - self.start_s + step_s + save_s + MARGIN_S >= self.limit_s

    def time_up(self, step: int, save_s: float) -> bool:
        """After each step: True on every rank when the time limit stops the job now (one small all-reduce on the
        CPU group, only with run.time_limit set); writes the time_limit event. Never after the last step: the run
        is finished there, and a stop would have a requeue script spend an allocation on a run with nothing left."""
        if not self.limit_s or step >= self.steps or not self.agree(self.due(save_s)):
            return False
        self.reason = "time_limit"
        elapsed = self.clock() - self.start_s
        self.event("time_limit", step=step, limit_s=self.limit_s, elapsed_s=elapsed, save_estimate_s=save_s,
                   step_estimate_s=max(self.step_times, default=0.0))  # fmt: skip
        log.warning("run.time_limit %s: stopping after step %d (%.1fs elapsed), saving a checkpoint",
                    self.limit_text, step, elapsed)  # fmt: skip
        return True

    def stopped(self, step: int) -> str | None:
        """Why this start ends before training.steps ("time_limit", "stop_at_step"), or None (finished, or ended by
        SIGTERM); writes the stop_at_step event."""
        # At it, or past it already (a resume beyond the stop step trains nothing): not finished either way.
        if self.reason is None and self.stop_at_step and self.stop_at_step <= step < self.steps:
            self.reason = "stop_at_step"
            self.event("stop_at_step", step=step, steps=self.steps)
            log.warning("run.stop_at_step %d of %d: stopping, saving a checkpoint", step, self.steps)
        return self.reason

    def source_dry(self, step: int, source: str, path: str, epoch: int) -> None:
        """data.when_dry = "stop": `source` was read to its end by the batch after `step`. The job ends after `step`
        as at the time limit (the loop stops, the final save commits `step`), but finished, not stopped: with nothing
        left to read, a requeue script's 75 would start it again only to stop again. Writes the source_dry event."""
        self.dry = {"source": source, "path": path, "epoch": epoch}
        self.event("source_dry", step=step, **self.dry)
        log.warning("data.when_dry = 'stop': %s (%s) has been read to its end (epoch %d) in the batch after step %d: "
                    "the run ends at step %d, saving a checkpoint of it; to read the source again in a new order, "
                    "run again with --data.when_dry repeat --run.accept_changes data.when_dry",
                    source, path, epoch, step, step)  # fmt: skip
