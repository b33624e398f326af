"""Goodput accounting from synthetic events.jsonl / metrics.jsonl: clean runs, restarts, rollbacks, stalls, evals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaletrain.resilience.goodput import compute_goodput

PARTS = ("productive_s", "restart_s", "recomputed_s", "checkpoint_stall_s", "eval_s", "other_s")


def _write(run_dir: Path, events: list[dict], records: list[dict]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "events.jsonl", "w") as f:
        for e in events:
            f.write(json.dumps({"step": None, **e}) + "\n")
    with open(run_dir / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps({"loss": 5.0, "tokens": 0, **r}) + "\n")
    return run_dir


def _check(g: dict) -> dict:
    """What every result must satisfy: parts that add up to the total, each non-negative, goodput in [0, 1]."""
    assert sum(g[k] for k in PARTS) == pytest.approx(g["total_s"])
    assert all(g[k] >= -1e-9 for k in PARTS), g
    assert 0.0 <= g["goodput"] <= 1.0
    assert g["goodput"] == pytest.approx(g["productive_s"] / g["total_s"])
    return g


def test_clean_run(tmp_path):
    events = [
        {"time": 100.0, "kind": "start", "step": 0, "resumed": False},
        {"time": 125.0, "kind": "end", "step": 20},
    ]
    records = [{"step": 10, "step_time_s": 1.0}, {"step": 20, "step_time_s": 1.2}]
    g = _check(compute_goodput(_write(tmp_path, events, records)))
    assert g["total_s"] == pytest.approx(25.0)
    assert g["productive_s"] == pytest.approx(10 * 1.0 + 10 * 1.2)
    assert g["goodput"] == pytest.approx(22.0 / 25.0)
    assert g["other_s"] == pytest.approx(3.0)
    assert (g["restart_s"], g["recomputed_s"], g["restarts"], g["failures"]) == (0.0, 0.0, 0, 0)


def test_a_running_job_counts_its_last_record_before_writing_it(tmp_path):
    # The final summary asks for goodput before the last record is written: that record and the time now count.
    events = [
        {"time": 100.0, "kind": "start", "step": 0},
        {"time": 110.0, "kind": "memory_snapshot", "step": 9},
    ]
    run = _write(tmp_path, events, [{"step": 10, "step_time_s": 1.0}])
    g = _check(compute_goodput(run, pending={"step": 20, "step_time_s": 0.5}, now=125.0))
    assert (g["total_s"], g["productive_s"]) == (pytest.approx(25.0), pytest.approx(15.0))


def test_job_start_counts_the_launch_before_the_first_worker(tmp_path):
    events = [
        {"time": 90.0, "kind": "job_start"},
        {"time": 100.0, "kind": "start", "step": 0},
        {"time": 125.0, "kind": "end", "step": 20},
    ]
    g = _check(compute_goodput(_write(tmp_path, events, [{"step": 20, "step_time_s": 1.0}])))
    assert g["total_s"] == pytest.approx(35.0)
    assert g["other_s"] == pytest.approx(15.0)


def _restart_run(timed: bool) -> tuple[list[dict], list[dict]]:
    """Segment 1 runs steps 1-17 at 0.5 s (logged at 5, 10, 15; checkpoint at 10) and fails at t=20; the launcher
    restarts it and segment 2 resumes from step 10 at t=30, running steps 11-20 at 0.4 s."""
    events = [
        {"time": 0.0, "kind": "start", "step": 0, "resumed": False},
        {"time": 5.5, "kind": "checkpoint_saved", "step": 10},
        {"time": 20.0, "kind": "failure", "step": None, "exitcode": 1},
        {"time": 21.0, "kind": "restart", "step": None},
        {"time": 30.0, "kind": "start", "step": 10, "resumed": True},
        {"time": 36.0, "kind": "end", "step": 20},
    ]
    records = [
        {"step": 5, "step_time_s": 0.5, "time": 3.0},
        {"step": 10, "step_time_s": 0.5, "time": 5.5},
        {"step": 15, "step_time_s": 0.5, "time": 8.0},
        {"step": 15, "step_time_s": 0.4, "time": 32.0},
        {"step": 20, "step_time_s": 0.4, "time": 34.0},
    ]
    if not timed:
        records = [{k: v for k, v in r.items() if k != "time"} for r in records]
    return events, records


@pytest.mark.parametrize("timed", [True, False], ids=["timed-records", "untimed-records"])
def test_restart_counts_recomputed_steps_and_the_restart_gap(tmp_path, timed):
    g = _check(compute_goodput(_write(tmp_path, *_restart_run(timed))))
    assert g["total_s"] == pytest.approx(36.0)
    # Steps 1-10 last ran in segment 1 (0.5 s), steps 11-20 in segment 2 (0.4 s): the re-run's time counts.
    assert g["productive_s"] == pytest.approx(10 * 0.5 + 10 * 0.4)
    assert g["recomputed_s"] == pytest.approx(5 * 0.5)  # steps 11-15 of segment 1
    assert g["restart_s"] == pytest.approx(30.0 - 20.0)  # from the failure, not the later restart event
    assert (g["restarts"], g["failures"]) == (1, 1)
    assert g["goodput"] == pytest.approx(9.0 / 36.0)


def test_a_resumed_window_starts_at_the_resume_step_not_the_last_record(tmp_path):
    # Segment 1 logged step 9 (log every 3), saved step 10 and died at 11; segment 2 resumes at 10 and logs 12:
    # its window is steps 11-12, and step 10's time is the one from segment 1's unlogged window (lost to other).
    events = [
        {"time": 0.0, "kind": "start", "step": 0},
        {"time": 12.0, "kind": "failure"},
        {"time": 20.0, "kind": "start", "step": 10},
        {"time": 23.0, "kind": "end", "step": 12},
    ]
    records = [{"step": 9, "step_time_s": 1.0, "time": 9.0}, {"step": 12, "step_time_s": 1.0, "time": 22.0}]
    g = _check(compute_goodput(_write(tmp_path, events, records)))
    assert g["productive_s"] == pytest.approx(9 + 2)
    assert g["recomputed_s"] == 0.0


def test_restart_without_a_failure_event_uses_the_last_sign_of_life(tmp_path):
    events = [
        {"time": 0.0, "kind": "start", "step": 0},
        {"time": 15.0, "kind": "start", "step": 0},
        {"time": 20.0, "kind": "end", "step": 4},
    ]
    records = [{"step": 4, "step_time_s": 1.0, "time": 4.5}, {"step": 4, "step_time_s": 1.0, "time": 19.0}]
    g = _check(compute_goodput(_write(tmp_path, events, records)))
    assert g["restart_s"] == pytest.approx(15.0 - 4.5)
    assert g["recomputed_s"] == pytest.approx(4.0)
    assert (g["restarts"], g["failures"]) == (1, 0)


def test_checkpoint_stalls_and_evals_are_subtracted(tmp_path):
    events = [
        {"time": 0.0, "kind": "start", "step": 0},
        {"time": 3.0, "kind": "eval", "step": 0, "val_loss": 6.0, "duration_s": 2.5},
        {"time": 14.0, "kind": "checkpoint_saved", "step": 10, "blocking_s": 0.75},
        {"time": 26.0, "kind": "checkpoint_saved", "step": 20, "blocking_s": 0.25},
        {"time": 27.0, "kind": "checkpoint_saved", "step": 20},  # a writer without blocking_s: nothing
        {"time": 29.0, "kind": "eval", "step": 20, "val_loss": 5.0, "duration_s": 1.5},
        {"time": 30.0, "kind": "end", "step": 20},
    ]
    records = [{"step": 10, "step_time_s": 1.0}, {"step": 20, "step_time_s": 1.0}]
    g = _check(compute_goodput(_write(tmp_path, events, records)))
    assert g["checkpoint_stall_s"] == pytest.approx(1.0)
    assert g["eval_s"] == pytest.approx(4.0)
    assert g["productive_s"] == pytest.approx(20.0)
    assert g["other_s"] == pytest.approx(30.0 - 20.0 - 1.0 - 4.0)


@pytest.mark.parametrize("timed", [True, False], ids=["rollback-event", "steps-went-back"])
def test_rollback_reruns_are_recomputed(tmp_path, timed):
    # NaN at step 8: roll back to the step-5 state in the same process and re-run steps 6-10.
    # Timed records: the rollback event's to_step says where the re-run began. Untimed: only the step numbers
    # say that a re-run began, and it is taken to begin after the newest checkpoint below it.
    events = [
        {"time": 0.0, "kind": "start", "step": 0},
        {"time": 5.0, "kind": "checkpoint_saved", "step": 5} if not timed else {"time": 5.0, "kind": "x"},
        {"time": 8.5, "kind": "rollback", "step": 8} | ({"to_step": 5} if timed else {}),
        {"time": 16.0, "kind": "end", "step": 10},
    ]
    records = [
        {"step": 4, "step_time_s": 1.0, "time": 4.0},
        {"step": 8, "step_time_s": 1.0, "time": 8.0},
        {"step": 6, "step_time_s": 0.5, "time": 9.5},
        {"step": 10, "step_time_s": 1.5, "time": 15.5},
    ]
    if not timed:
        records = [{k: v for k, v in r.items() if k != "time"} for r in records]
    g = _check(compute_goodput(_write(tmp_path, events, records)))
    assert g["productive_s"] == pytest.approx(5 * 1.0 + 0.5 + 4 * 1.5)
    assert g["recomputed_s"] == pytest.approx(3.0)  # the first runs of steps 6-8
    assert (g["restarts"], g["failures"]) == (0, 0)


def test_truncated_lines_are_skipped_and_a_run_needs_a_start(tmp_path):
    run = _write(
        tmp_path / "a",
        [{"time": 0.0, "kind": "start", "step": 0}, {"time": 10.0, "kind": "end"}],
        [{"step": 5, "step_time_s": 1.0}],
    )
    with open(run / "events.jsonl", "a") as f:
        f.write('{"time": 11.0, "kind": "fail')  # a crash in the middle of a line
    g = _check(compute_goodput(run))
    assert (g["total_s"], g["productive_s"]) == (10.0, 5.0)
    with pytest.raises(ValueError, match="no 'start' event"):
        compute_goodput(_write(tmp_path / "b", [{"time": 0.0, "kind": "job_start"}], []))


@pytest.mark.parametrize("where", ["main", "group"])
def test_a_replica_group_that_healed_forward_counts_only_the_steps_it_ran(tmp_path, where):
    """Fault tolerance: a group that fell behind takes its peers' weights at step 12 and goes on from step 13; steps
    6-12 were its peers' time, not its own (counting them put group 0's goodput at 102%). Group 0 writes in the run
    directory, group g > 0 under replicas/group-g; the other groups' replica_joined events are not its resets."""
    group = 0 if where == "main" else 1
    run = tmp_path / "run" if where == "main" else tmp_path / "run" / "replicas" / "group-1"
    events = [
        {"time": 100.0, "kind": "start", "step": 0},
        {"time": 105.5, "kind": "replica_joined", "step": 4, "group": 1 - group, "cause": "fell_behind"},
        {"time": 107.0, "kind": "replica_joined", "step": 12, "group": group, "cause": "fell_behind"},
        {"time": 116.0, "kind": "end", "step": 20},
    ]
    records = [
        {"step": 5, "step_time_s": 1.0, "time": 105.0},
        {"step": 20, "step_time_s": 1.0, "time": 115.0},
    ]
    g = _check(compute_goodput(_write(run, events, records)))
    assert g["productive_s"] == pytest.approx(5 * 1.0 + 8 * 1.0)  # steps 1-5 and 13-20


@pytest.mark.parametrize("timed", [True, False], ids=["timed-records", "untimed-records"])
def test_a_restarted_group_0_healed_past_its_checkpoint_counts_only_the_steps_it_logged(tmp_path, timed):
    """The torchft node-recovery drill's group 0 (tests/e2e/test_fault_tolerance's run directory, in its shape): it
    logs steps 1-7, dies, restarts from its checkpoint of step 5 and heals from its peer at step 60 (the peer went on
    alone meanwhile); its next record is step 61. Records written before they carried `time` held nothing to place
    the heal by: the window of step 61 was taken to cover steps 8-61, at that record's step time, and goodput read
    above 1 (2.03 in the drill). Group 1's heal, also in this directory's events, is not group 0's."""
    events = [
        {"time": 0.0, "kind": "job_start"},
        {"time": 26.0, "kind": "start", "step": 0},
        {"time": 31.0, "kind": "checkpoint_saved", "step": 5, "blocking_s": 0.25},
        {"time": 33.0, "kind": "replica_joined", "step": 6, "group": 1, "cause": "fell_behind"},
        {"time": 38.0, "kind": "failure", "step": 8},
        {"time": 38.0, "kind": "replica_lost", "step": 8, "group": 0},
        {"time": 42.0, "kind": "checkpoint_loaded", "step": 5},
        {"time": 42.0, "kind": "start", "step": 5},
        {"time": 43.0, "kind": "replica_joined", "step": 60, "group": 0, "cause": "restarted"},
        {"time": 45.0, "kind": "end", "step": 61},
    ]
    records = [{"step": s, "step_time_s": 0.5, "time": 26.5 + 0.5 * s} for s in range(1, 8)]
    records.append({"step": 61, "step_time_s": 1.5, "time": 44.5})
    if not timed:
        records = [{k: v for k, v in r.items() if k != "time"} for r in records]
    g = _check(compute_goodput(_write(tmp_path, events, records)))
    # Steps 1-7 and 61 (the old count: 7 * 0.5 + 54 * 1.5, goodput 1.88).
    assert g["productive_s"] == pytest.approx(7 * 0.5 + 1.5)
    assert (g["recomputed_s"], g["restart_s"], g["restarts"]) == (0.0, pytest.approx(42.0 - 38.0), 1)
