"""Straggler detection's busy clock, on CPU with fake clocks: on a GPU a rank's busy time is the device time of its
step's compute (CUDA events), which names a slow GPU that wall time, equal on every rank in lock step, cannot
(issue 24 item 4). tests/gpu/test_cuda.py times real events."""

from __future__ import annotations

import contextlib
import time

import torch

from scaletrain.config import ResilienceConfig
from scaletrain.parallel.mesh import DistEnv
from scaletrain.parallel.step import StepRunner
from scaletrain.resilience.busy import EventClock, ProcessClock
from scaletrain.resilience.guard import Guard
from scaletrain.resilience.straggler import slow_ranks
from tests.fixtures import tiny


class FakeDevice:
    """A device's own timeline: `run(s)` is s seconds of kernels; events record where the timeline is."""

    def __init__(self) -> None:
        self.t = 0.0
        self.done = True  # whether recorded events have completed (query())

    def run(self, seconds: float) -> None:
        self.t += seconds


class FakeEvent:
    device: FakeDevice  # set to the rank being driven

    def __init__(self, enable_timing: bool = False) -> None:
        self.on, self.at = FakeEvent.device, None

    def record(self, stream=None) -> None:
        self.at = self.on.t

    def query(self) -> bool:
        return self.on.done

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1000.0  # milliseconds, as torch.cuda.Event


def _guard(tmp_path, rank: int, device: str = "cuda", clock=None) -> Guard:
    env = DistEnv(rank=rank, world_size=2, local_rank=rank, local_world_size=2, device=torch.device(device))
    cfg = ResilienceConfig(straggler_factor=1.5, straggler_interval=1000)  # no gather in these steps
    return Guard(cfg, tmp_path / str(rank), env, None, lambda *a, **k: None, lambda x: x, clock=clock)


def test_a_gpu_rank_with_twice_the_device_compute_is_named_though_wall_times_are_equal(tmp_path, monkeypatch):
    """Lock step: both ranks take 3 s of wall time a step (the fast one waits in the gradient all-reduce), but
    rank 1's GPU needs 2 s for the compute its peer does in 1 s. The busy time on CUDA is the events' device time."""
    wall = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: wall[0])
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    devices = [FakeDevice(), FakeDevice()]
    guards = [_guard(tmp_path, rank) for rank in (0, 1)]
    for step in range(1, 5):
        for rank, guard in enumerate(guards):
            FakeEvent.device = devices[rank]
            guard.step_start(step)
            guard.clock.compute_start()
            devices[rank].run(1.0 * (rank + 1))
            guard.clock.compute_end()
            devices[rank].run(3.0 - 1.0 * (rank + 1))  # waiting on the peer in the collective
            guard.step_end(step)
        wall[0] += 3.0
    means = [g.straggler.mean() for g in guards]
    assert means == [1.0, 2.0]
    assert [s["rank"] for s in slow_ranks(means, 1.5)] == [1]
    for guard in guards:
        guard.close()


def test_wall_time_in_lock_step_names_nobody_and_cpu_time_names_the_slow_rank(tmp_path):
    """The same logic on CPU with a fake clock: ProcessClock over the step, fed wall time (equal) or CPU time."""
    wall, cpu = [0.0], [0.0, 0.0]
    by_wall = [_guard(tmp_path, r, "cpu", ProcessClock(lambda: wall[0])) for r in (0, 1)]
    by_cpu = [_guard(tmp_path, r, "cpu", ProcessClock(lambda r=r: cpu[r])) for r in (0, 1)]
    for step in range(1, 4):
        for rank in (0, 1):
            by_wall[rank].step_start(step), by_cpu[rank].step_start(step)
            cpu[rank] += 0.5 * (rank + 1)  # rank 1 works twice as long; a gloo wait uses no CPU
            by_wall[rank].step_end(step), by_cpu[rank].step_end(step)
        wall[0] += 1.0
    assert slow_ranks([g.straggler.mean() for g in by_wall], 1.5) == []
    assert [s["rank"] for s in slow_ranks([g.straggler.mean() for g in by_cpu], 1.5)] == [1]
    for guard in by_wall + by_cpu:
        guard.close()


def test_event_pairs_still_running_are_read_at_a_later_step_without_a_sync():
    device = FakeDevice()
    FakeEvent.device = device
    clock = EventClock(make_event=FakeEvent)
    clock.compute_start()
    device.run(0.25)
    clock.compute_end()
    device.done = False
    assert clock.step_end() == []  # not finished: nothing waited for, nothing lost
    clock.compute_start()
    device.run(0.5)
    clock.compute_end()
    device.done = True
    assert clock.step_end() == [0.25, 0.5]
    assert clock.step_end() == []


def test_the_step_runner_stops_the_busy_clock_before_the_last_backward():
    """The last micro-batch's backward starts the gradient collectives, which wait for the slowest peer."""
    marks = []

    class Recording(ProcessClock):
        def compute_start(self) -> None:
            marks.append("start")

        def compute_end(self) -> None:
            marks.append("end")

    model = tiny()
    next(model.parameters()).register_hook(lambda g: marks.append("backward"))
    runner = StepRunner([model], 1, contextlib.nullcontext(), 0.0, clock=Recording())
    x = torch.randint(0, 64, (2, 8))
    runner.forward_backward(x, x)
    assert marks == ["start", "backward", "end", "backward"]
