"""Straggler detection over 3 gloo ranks: the rank slowed by a `slow:` fault is named, the others are not."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from scaletrain.resilience.faults import FaultInjector
from scaletrain.resilience.straggler import StragglerMonitor
from tests.distributed.spawn import spawn

STEP_S = 0.02


def _ranks(rank: int, world_size: int, out: str) -> None:
    run_dir = Path(out)
    injector = FaultInjector(["slow:rank=2,factor=4,step=5"], rank=rank, run_dir=run_dir, event=lambda *a, **k: None)
    monitor = StragglerMonitor(factor=2.0, interval=4)
    reports = {}
    for step in range(1, 9):
        t0 = time.perf_counter()
        time.sleep(STEP_S)  # each rank's own work; there is no collective per step to even the times out
        injector.at_step_end(step, time.perf_counter() - t0)
        monitor.record(time.perf_counter() - t0)
        if step == 3:
            assert monitor.check(step, None) == []  # not a check step: no collective, nothing named
        if step % 4 == 0:
            reports[step] = monitor.check(step, dist.group.WORLD)
    (run_dir / f"rank{rank}.json").write_text(json.dumps(reports))


def test_the_slow_rank_is_named_on_every_rank(tmp_path):
    spawn(_ranks, 3, str(tmp_path))
    for rank in range(3):
        reports = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert reports["4"] == []  # steps 1-4: nobody is slow yet
        (slow,) = reports["8"]  # steps 5-8: rank 2 takes 4x as long
        assert slow["rank"] == 2
        assert 2.5 < slow["ratio"] < 6 and abs(slow["step_time_s"] - slow["ratio"] * slow["median_s"]) < 1e-9
        assert STEP_S <= slow["median_s"] < 3 * STEP_S


def test_one_process_returns_nothing_and_bad_settings_are_refused():
    monitor = StragglerMonitor(factor=2.0, interval=1)
    monitor.record(1.0)
    assert monitor.check(1) == []
    with pytest.raises(ValueError, match="factor must be > 1"):
        StragglerMonitor(factor=1.0, interval=10)
