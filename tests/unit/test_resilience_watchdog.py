"""The hang watchdog, for real in a subprocess (exit code, stacks file, event line), and the collective tracker."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from scaletrain.metrics.writer import append_event
from scaletrain.resilience import watchdog
from scaletrain.resilience.watchdog import HANG_EXIT_CODE, CollectiveTracker, Watchdog

ROOT = Path(__file__).resolve().parents[2]

HUNG_WORKER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch, torch.distributed as dist
    from scaletrain.resilience.watchdog import CollectiveTracker, Watchdog

    run_dir = Path(sys.argv[1])
    dist.init_process_group("gloo", init_method=f"file://{run_dir}/store", rank=0, world_size=1)
    tracker = CollectiveTracker()
    tracker.install()
    wd = Watchdog(1.0, run_dir, rank=3, tracker=tracker)

    def wait_for_peers():
        time.sleep(60)

    wd.step_started(1)
    dist.all_reduce(torch.ones(2))
    wd.step_finished()
    wd.step_started(2)
    dist.barrier()
    wait_for_peers()
    print("the watchdog did not fire", flush=True)
""")


def test_watchdog_ends_a_hung_process_with_stacks_and_an_event(tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", HUNG_WORKER, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=90,
    )
    assert proc.returncode == HANG_EXIT_CODE, proc.stdout + proc.stderr
    assert time.monotonic() - t0 < 60  # it did not wait out the sleep
    stacks = (tmp_path / "hang-rank3.txt").read_text()
    assert "rank 3, step 2" in stacks and '"name": "barrier"' in stacks
    assert "wait_for_peers" in stacks and stacks.count("hread 0x") >= 2  # the stuck thread and the watchdog's
    (line,) = (tmp_path / "events.jsonl").read_text().splitlines()
    event = json.loads(line)
    assert {k: event[k] for k in ("kind", "step", "rank", "timeout_s")} == {
        "kind": "hang",
        "step": 2,
        "rank": 3,
        "timeout_s": 1.0,
    }
    assert event["stacks_file"] == str(tmp_path / "hang-rank3.txt") and 1.0 <= event["elapsed_s"] < 10
    assert event["last_collective"]["name"] == "barrier" and event["last_collective"]["count"] == 2
    assert event["last_collective"]["group_size"] == 1 and isinstance(event["time"], float)


@pytest.fixture
def exits(monkeypatch) -> list[int]:
    """Stands in for os._exit, so that a watchdog firing by mistake fails the test instead of ending pytest."""
    calls: list[int] = []
    monkeypatch.setattr(watchdog, "_exit", calls.append)
    return calls


def test_steps_in_time_and_idle_time_between_steps_do_not_fire(tmp_path, exits):
    wd = Watchdog(0.15, tmp_path, rank=0)
    try:
        for step in (1, 2):
            wd.step_started(step)
            time.sleep(0.02)
            wd.step_finished()
        time.sleep(0.3)  # evaluation or a checkpoint between steps: not watched
        wd.step_started(3, timeout_s=5.0)  # a slow first step may get its own limit
        time.sleep(0.3)
        wd.step_finished()
    finally:
        wd.stop()
    assert exits == [] and not list(tmp_path.iterdir())
    assert not wd._thread.is_alive()


def test_watchdog_fires_on_an_overrun_step(tmp_path, exits):
    wd = Watchdog(0.1, tmp_path, rank=1)
    wd.step_started(7)
    wd._thread.join(timeout=5)  # the thread ends once it fired
    assert exits == [HANG_EXIT_CODE]
    event = json.loads((tmp_path / "events.jsonl").read_text())
    assert event["step"] == 7 and event["last_collective"] is None
    assert "test_watchdog_fires_on_an_overrun_step" in (tmp_path / "hang-rank1.txt").read_text()


def test_watchdog_rejects_a_zero_timeout(tmp_path):
    with pytest.raises(ValueError, match="timeout"):
        Watchdog(0, tmp_path, rank=0)


def test_tracker_records_the_last_collective_and_uninstalls(tmp_path):
    original = dist.all_reduce
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    tracker = CollectiveTracker()
    try:
        tracker.install()
        assert dist.all_reduce is not original
        t = torch.ones(3)
        work = dist.all_reduce(t, dist.ReduceOp.SUM, None, True)  # positional group, async: Work comes back
        work.wait()
        assert tracker.last["name"] == "all_reduce" and tracker.last["group_size"] == 1
        objs = [{"a": 1}]
        dist.broadcast_object_list(objs, src=0)
        assert objs == [{"a": 1}]
        assert (tracker.last["name"], tracker.count) == ("broadcast_object_list", 2)
        assert time.time() - tracker.last["time"] < 5
    finally:
        tracker.uninstall()
        dist.destroy_process_group()
    assert dist.all_reduce is original


def test_append_event_writes_strict_json_lines(tmp_path):
    append_event(tmp_path, "fault_injected", 4, rank=2, value=float("nan"))
    append_event(tmp_path, "hang", None, rank=0)
    lines = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["step"], e["rank"]) for e in lines] == [("fault_injected", 4, 2), ("hang", None, 0)]
    assert lines[0]["value"] is None and list(lines[0])[:3] == ["time", "kind", "step"]
