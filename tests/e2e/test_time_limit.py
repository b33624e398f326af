"""Bounded jobs end to end: run.time_limit and run.stop_at_step stop the debug job with exit status 75 and a
committed checkpoint, and the job continued to its end reproduces the golden (uninterrupted) losses bit for bit."""

import functools

from scaletrain.errors import STOPPED_EXIT_CODE
from scaletrain.run.directory import RunDir
from tests.golden.record import COMMON, golden_problem
from tests.helpers import events, per_step, train_cli


def _committed(run):
    return sorted(int(p.parent.name[5:]) for p in (run / "checkpoints").glob("step-*/commit.json"))


def test_time_limit_then_stop_at_step_then_the_rest_equals_the_uninterrupted_run(tmp_path):
    run = tmp_path / "run"
    train = functools.partial(train_cli, run, *COMMON, quick=False)  # COMMON holds QUICK
    # 1s from the process start has passed before the first step ends: the job stops after step 1 (every start
    # makes at least one step), saves it and exits 75.
    first = train(run__time_limit="1s", check=False)
    assert first.returncode == STOPPED_EXIT_CODE, first.stderr
    assert _committed(run) == [1]
    (limit,) = events(run, "time_limit")
    assert limit["step"] == 1 and limit["limit_s"] == 1.0 and limit["elapsed_s"] >= 1.0
    assert (
        events(run, "end")[-1]["stopped"] == "time_limit" and RunDir.at(run).exit_code() == STOPPED_EXIT_CODE
    )

    # The same command with a stop step instead (run.* may change on resume): steps 2..6, then exit 75 again.
    second = train(run__stop_at_step=6, check=False)
    assert second.returncode == STOPPED_EXIT_CODE, second.stderr
    assert _committed(run)[-1] == 6 and [e["step"] for e in events(run, "stop_at_step")] == [6]

    # Without either, the job runs to training.steps (20) and exits 0.
    train()
    assert RunDir.at(run).exit_code() == 0 and events(run, "end")[-1]["stopped"] is None
    assert [e["step"] for e in events(run, "checkpoint_loaded")] == [1, 6]
    got = per_step(run, ("loss", "grad_norm"))
    assert sorted(got) == list(range(1, 21))
    # The schedule of 20 steps throughout: the uninterrupted run's losses and grad norms, bit for bit.
    problem = golden_problem("single", {"loss": [got[s][0] for s in sorted(got)],
                                        "grad_norm": [got[s][1] for s in sorted(got)]}, ("loss", "grad_norm"))  # fmt: skip
    assert problem is None, problem
