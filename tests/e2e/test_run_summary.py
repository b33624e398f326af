"""The end-of-run summary (the `end` event, the printed table, the report) is the run's, at the step it stopped at: a
job stopped between two logged steps (SIGTERM, run.stop_at_step, run.time_limit) reports that step's tokens and loss,
and a resumed job reports the first validation loss of its first start. One job in three starts, against an
uninterrupted reference that logs every step."""

import os
import signal
import subprocess
import sys
import time

import pytest

from scaletrain.errors import STOPPED_EXIT_CODE
from scaletrain.report.runs import read_run
from tests.helpers import ROOT, events, per_step, train_args, train_cli

# 100000 steps (the schedule of every start), logged and evaluated every 1000: the stops below fall between logs.
ARGS = dict(
    training__deterministic=True, steps=100000, metrics__log_interval=1000, training__eval_interval=1000
)
TOKENS_PER_STEP = 8 * 64  # configs/debug.toml: global_batch 8 sequences of seq_len 64


def _sigterm_after_a_few_steps(run) -> None:
    cmd = [sys.executable, "-m", "scaletrain", *train_args(run, **ARGS)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ.copy())  # fmt: skip
    deadline = time.monotonic() + 120
    while not ((run / "events.jsonl").exists() and events(run, "eval")):  # the step-0 evaluation: steps begin
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """SIGTERM at step s; resumed to run.stop_at_step s + 3 (exit 75); resumed with a time limit already past, which
    stops it after one step, s + 4 (exit 75). The reference runs steps 1..s + 4 of the same schedule."""
    tmp = tmp_path_factory.mktemp("summary")
    run, ref = tmp / "run", tmp / "ref"
    _sigterm_after_a_few_steps(run)
    (pre,) = events(run, "preempted")
    s = pre["step"]
    for stop in ({"run__stop_at_step": s + 3}, {"run__time_limit": "1s"}):
        assert train_cli(run, **ARGS, **stop, check=False).returncode == STOPPED_EXIT_CODE
    ref_args = {**ARGS, "run__stop_at_step": s + 4, "metrics__log_interval": 1}
    assert train_cli(ref, **ref_args, check=False).returncode == 75
    first_val = events(run, "eval")[0]
    assert first_val["step"] == 0 and [e["step"] for e in events(run, "start")] == [0, s, s + 3]
    return {"s": s, "ends": events(run, "end"), "first_val": first_val["val_loss"], "run": run,
            "ref": per_step(ref, ("loss", "grad_norm")), "logged": per_step(run, ("loss", "grad_norm"))}  # fmt: skip


def _assert_ends_at(end: dict, step: int, job: dict) -> None:
    assert end["step"] == end["steps"] == step
    assert end["tokens"] == step * TOKENS_PER_STEP
    assert end["final_loss"] == job["ref"][step][0]  # the loss of that very step (deterministic: bit for bit)
    # The stop step was logged, though not a log step: the metrics and the report show where the run stopped.
    assert job["logged"][step] == job["ref"][step]


def test_sigterm_between_logged_steps_reports_the_step_it_stopped_at(job):
    s, end = job["s"], job["ends"][0]
    assert s % 1000 != 0, "SIGTERM landed on a logged step: the test proves nothing"
    _assert_ends_at(end, s, job)
    assert end["stopped"] is None and end["first_val_loss"] == end["final_val_loss"] == job["first_val"]


def test_stop_at_step_and_time_limit_between_logged_steps_report_the_runs_figures(job):
    """Both resumed starts evaluate nothing of their own: the validation losses are the run's, from its first start
    (a resumed start used to report None, or its own first evaluation)."""
    s, (_, at_step, timed) = job["s"], job["ends"]
    _assert_ends_at(at_step, s + 3, job)
    _assert_ends_at(timed, s + 4, job)
    assert (at_step["stopped"], timed["stopped"]) == ("stop_at_step", "time_limit")
    for end in (at_step, timed):
        assert end["first_val_loss"] == end["final_val_loss"] == job["first_val"]
    summary = read_run(job["run"]).summary  # what `scaletrain report` shows
    assert summary["tokens"] == (s + 4) * TOKENS_PER_STEP and summary["first_val_loss"] == job["first_val"]
