"""A rank is never held by two live processes (issue 41): the same command started again on a run directory whose
job still trains is refused before it trains or writes, naming the process that holds the rank; the first job goes
on untouched. The user's form: the documented command, twice, from the project root."""

from __future__ import annotations

import time

from tests.helpers import events, read_jsonl, start_cli, train_args, train_cli


def test_a_second_process_of_a_live_rank_is_refused_with_the_holder_named(tmp_path):
    run = tmp_path / "run"
    args = dict(steps=600, training__eval_interval=0, checkpoint__interval=50, metrics__log_interval=1)
    first = start_cli(*train_args(run, **args))
    try:
        deadline = time.monotonic() + 120
        while not _events(
            run, "checkpoint_saved"
        ):  # resumable: the run-directory checks let a second start on
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.2)
        second = train_cli(run, check=False, timeout=120, **args)
        assert second.returncode != 0
        assert f"rank 0 of this run is held by a live process (pid {first.pid} on " in second.stderr, (
            second.stderr
        )
        assert first.poll() is None, "the first job was disturbed"
    finally:
        out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    steps = [m["step"] for m in read_jsonl(run / "metrics.jsonl")]
    assert steps == list(range(1, 601))  # the refused start logged nothing, and the first one every step once
    assert [e["step"] for e in events(run, "start")] == [0]


def _events(run, kind: str) -> list[dict]:
    return events(run, kind) if (run / "events.jsonl").exists() else []
