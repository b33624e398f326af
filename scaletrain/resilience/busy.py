"""A rank's busy time per step, for straggler detection: CPU time of the process on CPU, device time of the step's
compute (CUDA events) on a GPU. In lock-step training wall time is the same on every rank (the fast ones wait in
the collectives), so neither clock may count time spent waiting for peers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch


class BusyClock(Protocol):
    """The guard calls `step_start` / `step_end`; the step runner brackets its compute with `compute_start` /
    `compute_end`. `step_end` returns the busy seconds of each step whose measure is ready (none, one, or several
    when a device measure lags behind)."""

    def step_start(self) -> None: ...
    def compute_start(self) -> None: ...
    def compute_end(self) -> None: ...
    def step_end(self) -> list[float]: ...


class ProcessClock:
    """CPU: the process's CPU time over the whole step. A gloo wait blocks without using the CPU, so CPU time is the
    rank's own work. `now` is time.process_time, or a fake clock in tests."""

    def __init__(self, now: Callable[[], float] = time.process_time) -> None:
        self.now = now
        self._t0 = 0.0

    def step_start(self) -> None:
        self._t0 = self.now()

    def compute_start(self) -> None:
        pass

    def compute_end(self) -> None:
        pass

    def step_end(self) -> list[float]:
        return [self.now() - self._t0]


class EventClock:
    """CUDA: device time between two events on the compute stream, recorded by the step runner before the first
    forward and before the last micro-batch's backward (whose gradient collectives wait for the slowest peer; under
    pipeline parallel the whole schedule, its point-to-point waits included). The host waits for the device either
    way, so wall and CPU time cannot tell a throttled GPU from its peers; NVIDIA's straggler detector times kernels
    too (with CUPTI).

    No sync of its own: a pair is read once its end event has completed (`query()`), normally at the step's end,
    since the loss checks copy to the host; a pair still running is read at a later step. `make_event` builds the
    events (a fake in tests)."""

    def __init__(self, make_event: Callable[[], Any] | None = None) -> None:
        self.make_event = make_event or (lambda: torch.cuda.Event(enable_timing=True))
        self._open: Any = None
        self._pending: list[tuple[Any, Any]] = []

    def step_start(self) -> None:
        pass

    def compute_start(self) -> None:
        self._open = self.make_event()
        self._open.record()

    def compute_end(self) -> None:
        if self._open is None:
            return
        end = self.make_event()
        end.record()
        self._pending.append((self._open, end))
        self._open = None

    def step_end(self) -> list[float]:
        ready, running = [], []
        for pair in self._pending:
            (ready if pair[1].query() else running).append(pair)
        self._pending = running
        return [s.elapsed_time(e) / 1000.0 for s, e in ready]  # elapsed_time is in milliseconds


def clock_for(device_type: str) -> BusyClock:
    """The busy clock for a run's device type: CUDA events on "cuda", the process's CPU time otherwise."""
    return EventClock() if device_type == "cuda" else ProcessClock()
