"""Goodput: the share of a job's wall-clock time, across all its restarts, spent on training steps that count.

`compute_goodput(run_dir)` reads `events.jsonl` and `metrics.jsonl` and splits the job's wall-clock time into
disjoint parts that add up to it exactly:

- `total_s`: the last time stamp in the run directory (any event, or a metrics record's `time`) minus the first
  `job_start` or `start` event.
- `productive_s`: the step time of every step number's LAST execution. A metrics record covers the steps after
  the previous record of the same run segment (a segment begins at a `start` event, at a `rollback` event's
  `to_step`, or at the step a fault-tolerant replica group healed to: its own `replica_joined`), each taking the
  record's `step_time_s`.
- `recomputed_s`: the step time of every earlier execution of a step (re-run after a restart or a rollback).
- `restart_s`: for each `start` after the first, the time since the previous segment stopped: its earliest
  `failure`, `restart`, `hang`, `preempted`, `interrupted` or `end` event; without one, its last time stamp when
  metrics records carry `time` (otherwise the gap stays in `other_s`). This includes re-initialisation and the
  checkpoint load, since a worker writes `start` only once it is ready to train.
- `checkpoint_stall_s`: the sum of `checkpoint_saved` events' `blocking_s`.
- `eval_s`: the sum of `eval` events' `duration_s`.
- `other_s`: the rest — first start-up, data preparation, logging, steps run after the last record before a
  failure (no record tells their time), waiting in a queue between preemption and resumption.

`goodput = productive_s / total_s`. `restarts` counts `start` events after the first; `failures` counts `failure`
events.

Fields relied on (every event has `time`, `kind`, `step`):
- `start.step`: the step the segment resumes from (0 for a fresh run); `job_start` (optional, launcher) marks the
  job's beginning before any worker starts.
- `rollback.to_step`: the step whose state was restored (without it a rollback is inferred from steps going back).
- `checkpoint_saved.blocking_s`, `eval.duration_s`: seconds the training loop was stopped for them.
- metrics records: `step`, `step_time_s` — which must EXCLUDE eval and checkpoint blocking time (as the loop
  already excludes eval) or those seconds are counted twice and `other_s` comes out short — and, optionally,
  `time` (wall clock at logging, like events; the writer stamps it). With `time`, records are placed between events
  exactly; without it (run directories written before records carried it), a new segment is recognised only where
  the step number goes back, and its first window is taken to begin at the largest resume point below that step (a
  `start.step`, `rollback.to_step` or `checkpoint_saved.step`), or where it jumps forward over this group's own
  `replica_joined` step (a heal: the steps up to it were the peers').
- `replica_joined.group` and `.step` (fault tolerance): the group that healed and the step it received.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from scaletrain.run.directory import RunDir

# Events after which the segment has stopped training; the time from the earliest one to the next `start` is
# restart time.
STOP_KINDS = ("failure", "restart", "hang", "preempted", "interrupted", "end")


def compute_goodput(run_dir: Path, pending: dict | None = None, now: float | None = None) -> dict:
    """Goodput of the job whose records are in `run_dir`, and where the rest of its time went (see module doc).
    A running job asks before writing its last record: `pending` is that record and `now` the job's end.

    Returns {goodput, total_s, productive_s, restart_s, recomputed_s, checkpoint_stall_s, eval_s, other_s,
    restarts, failures}.
    """
    run_dir = Path(run_dir)
    events = sorted(
        (e for e in RunDir(run_dir).read_events() if _num(e.get("time")) is not None),
        key=lambda e: e["time"],
    )
    records = [r for r in RunDir(run_dir).read_metrics() + [pending or {}] if isinstance(r.get("step"), int)]
    starts = [e for e in events if e.get("kind") == "start"]
    if not starts:
        raise ValueError(
            f"{run_dir / 'events.jsonl'} has no 'start' event: is {run_dir} a run directory whose "
            "training started?"
        )
    timed = bool(records) and all(_num(r.get("time")) is not None for r in records)

    t0 = min(e["time"] for e in events if e.get("kind") in ("start", "job_start"))
    t_end = max([events[-1]["time"]] + ([r["time"] for r in records] if timed else []) + [now or 0.0])
    total = max(0.0, t_end - t0)
    productive, recomputed = _step_time(events, records, timed, _group_of(run_dir))
    restart = _restart_time(events, starts, records if timed else None)
    stall = sum(_num(e.get("blocking_s")) or 0.0 for e in events if e.get("kind") == "checkpoint_saved")
    eval_s = sum(_num(e.get("duration_s")) or 0.0 for e in events if e.get("kind") == "eval")
    return {
        "goodput": productive / total if total > 0 else 0.0,
        "total_s": total,
        "productive_s": productive,
        "restart_s": restart,
        "recomputed_s": recomputed,
        "checkpoint_stall_s": stall,
        "eval_s": eval_s,
        # Negative only when the inputs count a second twice (e.g. step_time_s including checkpoint blocking).
        "other_s": total - productive - restart - recomputed - stall - eval_s,
        "restarts": len(starts) - 1,
        "failures": sum(1 for e in events if e.get("kind") == "failure"),
    }


def final_goodput(run_dir: Path) -> float | None:
    """The job's goodput up to now (what the end-of-run summary reports), None when its records cannot say."""
    try:
        return compute_goodput(run_dir, now=time.time())["goodput"]
    except (ValueError, OSError):
        return None


def _step_time(events: list[dict], records: list[dict], timed: bool, group: int) -> tuple[float, float]:
    """(productive, recomputed) seconds: each step's last execution, and all its earlier ones."""
    resets = [(e["time"], _resume_step(e, group)) for e in events if _resume_step(e, group) is not None]
    # Where training can have gone back to: a start's or a rollback's step, or any saved checkpoint.
    resume_points = sorted(
        {step for _, step in resets}
        | {
            e["step"]
            for e in events
            if e.get("kind") == "checkpoint_saved" and isinstance(e.get("step"), int)
        }
    )
    # Untimed records: a heal is known only by its step, which a window jumping forward over it did not run.
    joined = [_resume_step(e, group) for e in events if e.get("kind") == "replica_joined"]
    heals = [step for step in joined if step is not None]
    if timed:
        # Resets before records of the same instant: a segment's `start` is written before its first step.
        timeline = sorted(
            [(t, 0, step) for t, step in resets] + [(r["time"], 1, r) for r in records],
            key=lambda item: (item[0], item[1]),
        )
    else:
        timeline = [(0.0, 1, r) for r in records]
    base = resets[0][1] if resets else 0  # the first start's step
    last_time: dict[int, float] = {}  # step -> seconds of its latest execution
    executed = 0.0
    for _, is_record, item in timeline:
        if not is_record:
            base = item
            continue
        step, seconds = item["step"], _num(item.get("step_time_s")) or 0.0
        if step <= base:
            # The steps went back with no event to say where from: take the largest resume point below.
            base = max((s for s in resume_points if s < step), default=step - 1)
        elif not timed:
            base = max((s for s in heals if base < s < step), default=base)
        for s in range(base + 1, step + 1):
            last_time[s] = seconds
            executed += seconds
        base = step
    productive = sum(last_time.values())
    return productive, executed - productive


def _resume_step(event: dict, group: int = 0) -> int | None:
    """The step after which training continues from this event: a start's step, a rollback's to_step, and under
    fault tolerance the step a replica group (this directory's: `group`) healed to from its peers — it did not
    run the steps it skipped, so they are not its productive time."""
    kind = event.get("kind")
    if kind == "start":
        return event.get("step") or 0
    if kind == "rollback" and isinstance(event.get("to_step"), int):
        return event["to_step"]
    if kind == "replica_joined" and event.get("group") == group and isinstance(event.get("step"), int):
        return event["step"]
    return None


def _group_of(run_dir: Path) -> int:
    """The replica group whose records `run_dir` holds: group g > 0 writes under replicas/group-g, group 0 (and a
    run without fault tolerance) in the run directory itself."""
    if run_dir.parent.name == "replicas" and run_dir.name.startswith("group-"):
        return int(run_dir.name.removeprefix("group-"))
    return 0


def _restart_time(events: list[dict], starts: list[dict], timed_records: list[dict] | None) -> float:
    total = 0.0
    for prev, nxt in zip(starts, starts[1:]):
        between = [e for e in events if prev["time"] < e["time"] < nxt["time"]]
        stops = [e["time"] for e in between if e.get("kind") in STOP_KINDS]
        if stops:
            stopped = min(stops)
        elif timed_records is not None:  # no word of the stop: the segment's last sign of life
            alive = [e["time"] for e in between] + [
                r["time"] for r in timed_records if prev["time"] <= r["time"] < nxt["time"]
            ]
            stopped = max(alive, default=prev["time"])
        else:
            continue  # untimed records may lie anywhere in the gap: leave it to other_s rather than count twice
        total += nxt["time"] - stopped
    return total


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)
