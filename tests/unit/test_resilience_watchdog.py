"""The hang watchdog, for real in a subprocess (exit code, stacks file, event line, the last collective from torch's
flight recorder)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from scaletrain.metrics.writer import append_event
from scaletrain.resilience import watchdog
from scaletrain.resilience.watchdog import HANG_EXIT_CODE, Watchdog

ROOT = Path(__file__).resolve().parents[2]

HUNG_WORKER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch, torch.distributed as dist
    from scaletrain.resilience.watchdog import Watchdog

    run_dir = Path(sys.argv[1])
    dist.init_process_group("gloo", init_method=f"file://{run_dir}/store", rank=0, world_size=1)
    wd = Watchdog(1.0, run_dir, rank=3)

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
    assert "rank 3, step 2" in stacks and '"name": "gloo:barrier"' in stacks
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
    last = event["last_collective"]  # torch's flight recorder: the second collective of the default group
    assert {k: last[k] for k in ("name", "group", "seq", "in_flight")} == {
        "name": "gloo:barrier",
        "group": "default_pg",
        "seq": 2,
        "in_flight": False,  # it returned; the process hangs after it
    }
    assert 0.5 <= last["seconds_ago"] < 30 and isinstance(event["time"], float)
    # The recorder's whole dump, torch's pickle.
    dump = pickle.loads((tmp_path / "flight_recorder" / "rank3").read_bytes())
    assert [e["profiling_name"] for e in dump["entries"]] == ["gloo:all_reduce", "gloo:barrier"]


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
    assert event["step"] == 7 and "last_collective" in event  # None here unless an earlier test made a group
    assert "test_watchdog_fires_on_an_overrun_step" in (tmp_path / "hang-rank1.txt").read_text()


def test_watchdog_rejects_a_zero_timeout(tmp_path):
    with pytest.raises(ValueError, match="timeout"):
        Watchdog(0, tmp_path, rank=0)


def test_append_event_writes_strict_json_lines(tmp_path):
    append_event(tmp_path, "fault_injected", 4, rank=2, value=float("nan"))
    append_event(tmp_path, "hang", None, rank=0)
    lines = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["step"], e["rank"]) for e in lines] == [("fault_injected", 4, 2), ("hang", None, 0)]
    assert lines[0]["value"] is None and list(lines[0])[:3] == ["time", "kind", "step"]
