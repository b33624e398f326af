"""A rank is never held by two live processes (issue 41): the same command started again on a run directory whose
job still trains is refused before it trains or writes, naming the process that holds the rank; the first job goes
on untouched. The user's form: the documented command, twice, from the project root."""

from __future__ import annotations

import signal
import time

from tests.helpers import events, read_jsonl, start_cli, train_args, train_cli


def test_a_second_process_of_a_live_rank_is_refused_with_the_holder_named(tmp_path):
    run = tmp_path / "run"
    args = dict(steps=20000, training__eval_interval=0, checkpoint__interval=20, metrics__log_interval=1)
    first = start_cli(*train_args(run, **args))
    try:
        deadline = time.monotonic() + 120
        # Resumable once a checkpoint is committed: the run-directory checks then let a second start through.
        while not _events(run, "checkpoint_saved"):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.2)
        second = train_cli(run, check=False, timeout=120, **args)
        assert second.returncode != 0
        held = f"rank 0 of this run is held by a live process (pid {first.pid} on "
        assert held in second.stderr, second.stderr
        assert first.poll() is None, "the first job was disturbed"
    finally:
        first.send_signal(signal.SIGTERM)  # stops after a step, with a committed save
        out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    steps = [m["step"] for m in read_jsonl(run / "metrics.jsonl")]
    # The refused start logged nothing; the first one logged every step once, to where SIGTERM stopped it.
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] > 20
    assert [e["step"] for e in events(run, "start")] == [0]


def _events(run, kind: str) -> list[dict]:
    return events(run, kind) if (run / "events.jsonl").exists() else []
