"""run.time_limit and run.stop_at_step without a clock or a process group: duration parsing, the stop decision with
an injected clock, the agreement of two ranks whose clocks differ, the validation and the exit status read back."""

from __future__ import annotations

import json
import threading

import pytest

from scaletrain.config import RunConfig
from scaletrain.errors import STOPPED_EXIT_CODE, ConfigError
from scaletrain.resilience import timelimit
from scaletrain.resilience.timelimit import MARGIN_S, JobLimits, limit_problems, parse_duration
from scaletrain.run.directory import RunDir
from scaletrain.run.resume import resume_problems
from scaletrain.validate import load_config


@pytest.mark.parametrize(
    "text, seconds",
    [("90s", 90), ("45m", 2700), ("2h", 7200), ("3h50m", 13800), ("1h30m15s", 5415), ("5400", 5400),
     ("0.5s", 0.5), (" 2H ", 7200)],
)  # fmt: skip
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "3h50", "50m3h", "1d", "h", "-5", "0s", "inf", "1h 30m", "nan"])
def test_bad_durations_name_the_accepted_forms(text):
    with pytest.raises(ValueError, match=r'run.time_limit .* "3h50m"'):
        parse_duration(text)


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _limits(limit: str, clock: Clock, start: float = 0.0, **kw) -> JobLimits:
    return JobLimits(RunConfig(time_limit=limit, **kw), 100, None, clock=clock, start_s=start)


def test_stops_when_one_more_step_and_the_save_would_pass_the_limit():
    clock, events = Clock(10.0), []
    limits = JobLimits(RunConfig(time_limit="100s"), 100, None, lambda k, **f: events.append((k, f)),
                       clock=clock, start_s=0.0)  # fmt: skip
    assert limits.begin(0) == 100
    stops = []
    for step in range(1, 100):
        clock.now += 10.0  # every step takes 10 s
        if limits.time_up(step, save_s=20.0):
            stops.append(step)
            break
    # After step k it is 10 + 10k s; one more step (10 s), the save (20 s) and the margin must fit in 100 s.
    want = next(k for k in range(1, 100) if 10 + 10 * k + 10 + 20 + MARGIN_S >= 100)
    assert stops == [want] and limits.stopped(want) == "time_limit"
    assert events == [("time_limit", dict(step=want, limit_s=100.0, elapsed_s=10 + 10 * want,
                                          save_estimate_s=20.0, step_estimate_s=10.0))]  # fmt: skip


def test_the_longest_recent_step_counts_and_the_save_estimate_moves_the_stop_earlier():
    clock = Clock()
    limits = _limits("1000s", clock)
    limits.begin(0)
    clock.now = 100.0  # a slow first step (compile, warm-up): 100 s
    assert not limits.time_up(1, save_s=0.0)
    clock.now = 101.0
    assert limits.due(save_s=0.0) is False  # 101 + 100 + margin < 1000
    assert limits.due(save_s=900.0) is True  # the measured save no longer fits


def test_every_start_makes_one_step_and_no_limit_means_no_collective():
    clock = Clock(5000.0)  # long past the limit already at the start
    calls = []
    limits = JobLimits(RunConfig(time_limit="60s"), 100, None, clock=clock, start_s=0.0,
                       agree=lambda flag: calls.append(flag) or flag)  # fmt: skip
    limits.begin(7)  # the loop asks only after a step: the first step of a start always runs
    assert limits.time_up(8, 0.0) and calls == [True]
    off = JobLimits(RunConfig(), 100, None, clock=clock, start_s=0.0, agree=lambda f: calls.append(f) or f)
    off.begin(0)
    assert not off.time_up(1, 0.0) and calls == [True]  # off: not even the all-reduce


def test_the_last_step_finishes_the_run_rather_than_stopping_it():
    """Past the limit at the last step (100 of 100): the run is finished (exit 0), not stopped to be continued
    (exit 75, on which the Slurm recipe requeues it for an allocation with nothing left to train)."""
    clock = Clock(5000.0)
    limits = _limits("60s", clock)
    limits.begin(99)
    assert not limits.time_up(100, 0.0) and limits.stopped(100) is None


def test_two_ranks_with_different_clocks_stop_after_the_same_step():
    """Rank 1's clock is 30 s ahead; the all-reduce (MAX of the flags, faked over a barrier) stops both."""
    flags, barrier = [False, False], threading.Barrier(2)

    def all_reduce_max(rank: int, flag: bool) -> bool:
        flags[rank] = flag
        barrier.wait()
        out = any(flags)
        barrier.wait()
        return out

    stopped_at = [None, None]

    def rank_main(rank: int) -> None:
        clock = Clock(30.0 * rank)
        limits = JobLimits(RunConfig(time_limit="100s"), 50, None, clock=clock, start_s=0.0,
                           agree=lambda f: all_reduce_max(rank, f))  # fmt: skip
        limits.begin(0)
        for step in range(1, 50):
            clock.now += 5.0
            if limits.time_up(step, 1.0):
                stopped_at[rank] = step
                return

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    alone = next(k for k in range(1, 50) if 30 + 5 * k + 5 + 1 + MARGIN_S >= 100)  # rank 1 on its own
    assert stopped_at == [alone, alone]


def test_stop_at_step_ends_the_loop_there_and_says_so():
    events = []
    limits = JobLimits(RunConfig(stop_at_step=6), 20, None, lambda k, **f: events.append((k, f)))
    assert limits.begin(2) == 6
    assert limits.stopped(6) == "stop_at_step" and events == [("stop_at_step", {"step": 6, "steps": 20})]
    assert JobLimits(RunConfig(stop_at_step=20), 20, None).stopped(20) is None  # that is the end: finished
    assert JobLimits(RunConfig(stop_at_step=6), 20, None).stopped(4) is None  # ended sooner by SIGTERM
    assert JobLimits(RunConfig(stop_at_step=6), 20, None).stopped(9) == "stop_at_step"  # resumed past it
    assert JobLimits(RunConfig(), 20, None).stopped(9) is None


def test_validation_and_resume():
    assert limit_problems(RunConfig(time_limit="3h50m", stop_at_step=5), 10, True) == []
    (bad,) = limit_problems(RunConfig(time_limit="soon"), 10, True)
    assert "'soon'" in bad and "3h50m" in bad
    (past,) = limit_problems(RunConfig(stop_at_step=11), 10, True)
    assert "training.steps 10" in past
    (neg,) = limit_problems(RunConfig(stop_at_step=-1), 10, True)
    assert ">= 0" in neg
    (off,) = limit_problems(RunConfig(stop_at_step=5), 10, False)
    assert "checkpoint.enabled = true" in off
    with pytest.raises(ConfigError, match="run.time_limit '4 hours'"):
        load_config(None, ["--run.time_limit", "4 hours", "--data.tokenizer", "byte"], check_run_dir=False)
    # A job split into allocations changes these keys between starts: a resume takes them.
    saved, new = (
        {"run": {"stop_at_step": 6, "time_limit": "1s"}},
        {"run": {"stop_at_step": 0, "time_limit": ""}},
    )
    assert resume_problems(saved, new, []) == []


def test_job_start_from_the_environment(monkeypatch):
    monkeypatch.setenv(timelimit.JOB_START_ENV, "1700000000")
    assert timelimit.job_start() == 1700000000.0
    monkeypatch.setenv(timelimit.JOB_START_ENV, "yesterday")
    with pytest.raises(Exception, match=r"SCALETRAIN_JOB_START is 'yesterday'.*date \+%s"):
        timelimit.job_start()
    monkeypatch.delenv(timelimit.JOB_START_ENV)
    assert 0 < timelimit.process_start() <= timelimit._IMPORTED_AT


def test_exit_code_read_back_from_the_last_start(tmp_path):
    def write(*records):
        (tmp_path / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    assert RunDir.at(tmp_path).exit_code() == 0  # no events at all
    write({"kind": "start"}, {"kind": "end", "stopped": "time_limit"})
    assert RunDir.at(tmp_path).exit_code() == STOPPED_EXIT_CODE
    write({"kind": "start"}, {"kind": "end", "stopped": "time_limit"}, {"kind": "start"}, {"kind": "end"})
    assert RunDir.at(tmp_path).exit_code() == 0
    write({"kind": "end", "stopped": "stop_at_step"}, {"kind": "start"}, {"kind": "checkpoint_saved"})
    assert RunDir.at(tmp_path).exit_code() == 0  # the last start did not end (a crash): not a stop


@pytest.mark.parametrize("async_save", [False, True])
def test_the_checkpoint_manager_measures_whole_saves(tmp_path, async_save):
    """What the time limit keeps for the final save: a save from its start to its commit, background part too."""
    import time

    import torch

    from scaletrain.checkpoint import CheckpointManager
    from scaletrain.config import CheckpointConfig

    state = {"w": torch.randn(64, 64)}
    mgr = CheckpointManager(
        CheckpointConfig(async_save=async_save), str(tmp_path), state, rank=0, world_size=1
    )
    assert mgr.save_seconds == 0.0
    t0 = time.perf_counter()
    blocked = mgr.save(1)
    assert mgr.wait()
    wall = time.perf_counter() - t0
    assert 0 < mgr.save_seconds <= wall and mgr.committed_steps() == [1]
    if async_save:  # blocked is only the copy to memory; the write and the commit came after it
        assert mgr.save_seconds >= blocked
    mgr.shutdown()
