"""Failure classification from exit status, signal and log tail; the restart policy; error-file and tail helpers."""

from __future__ import annotations

import json
import signal
import traceback

import pytest

from scaletrain.resilience.diagnose import (
    Diagnosis,
    RestartPolicy,
    classify,
    last_exception,
    parse_step,
    read_error_file,
    root_cause,
    tail,
)
from scaletrain.resilience.watchdog import HANG_EXIT_CODE

LOG_STEPS = (
    "12:00:01 INFO step 10/100 | loss 5.1234 | lr 1.00e-03 | gnorm 1.000 | 900 tok/s | mfu 1.00% | mem 10 MiB\n"
    "12:00:02 INFO step 20/100 | loss 4.9000 | lr 1.00e-03 | gnorm 0.900 | 910 tok/s | mfu 1.00% | mem 10 MiB\n"
)


def _traceback_of(exc: BaseException) -> str:
    """A real traceback as Python prints it, raised and caught here (chained when exc has a cause)."""
    try:
        try:
            raise KeyError("inner")
        except KeyError as inner:
            raise exc from inner
    except BaseException:
        return traceback.format_exc()


def test_traceback_is_a_user_exception_with_its_last_line_and_step():
    log = LOG_STEPS + _traceback_of(ValueError("shapes (4, 8) and (9, 8) do not match"))
    d = classify(1, None, log)
    assert d == Diagnosis("user_exception", True, "ValueError: shapes (4, 8) and (9, 8) do not match", 20)


@pytest.mark.parametrize("prefix", ["[default0]:", "[rank0]: "])
def test_chained_and_prefixed_traceback_reports_the_exception_that_ended_the_process(prefix):
    # torchrun --tee prefixes worker lines with "[default0]:", torch.distributed's excepthook with "[rank0]: ";
    # the chained KeyError's traceback comes first.
    tb = _traceback_of(RuntimeError("boom at step 33"))
    log = "".join(f"{prefix}{line}\n" for line in tb.splitlines())
    assert "KeyError" in log and log.count("Traceback") == 2
    d = classify(1, None, log)
    assert (d.kind, d.detail, d.step) == ("user_exception", "RuntimeError: boom at step 33", 33)
    assert last_exception("no traceback here\nValueError: looks like one but is not") is None


@pytest.mark.parametrize(
    "line",
    [
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total capacity)",
        "RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried",
        "OSError: [Errno 12] Cannot allocate memory",
    ],
)
def test_out_of_memory_wins_over_the_traceback_around_it(line):
    log = LOG_STEPS + 'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n' + line + "\n"
    d = classify(1, None, log)
    assert (d.kind, d.curable, d.step) == ("out_of_memory", True, 20)
    assert d.detail == line


def test_sigkill_is_oom_only_with_an_oom_killer_hint():
    hint = "Memory cgroup out of memory: Killed process 4242 (python) total-vm:1234kB\n"
    assert classify(-9, signal.SIGKILL, LOG_STEPS + hint).kind == "out_of_memory"
    for exitcode, sig in ((-9, None), (137, None), (None, signal.SIGKILL)):
        d = classify(exitcode, sig, LOG_STEPS)
        assert (d.kind, d.curable, d.step) == ("killed", True, 20), (exitcode, sig)


@pytest.mark.parametrize(
    "line",
    [
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms "
        "for recv operation to complete",
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:2919",
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection reset by peer",
        "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, Timeout(ms)=600000)",
    ],
)
def test_collective_timeouts(line):
    log = LOG_STEPS + 'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n' + line + "\n"
    d = classify(1, None, log)
    assert (d.kind, d.curable, d.detail) == ("collective_timeout", True, line)


def test_hang_uses_the_watchdog_exit_code():
    d = classify(HANG_EXIT_CODE, None, LOG_STEPS)
    assert (d.kind, d.curable, d.step) == ("hang", True, 20)


def test_nan_after_rollbacks_are_exhausted():
    log = LOG_STEPS + "12:00:03 ERROR non-finite loss at step 23: rollbacks exhausted (3 of 3)\n"
    d = classify(1, None, log)
    assert (d.kind, d.curable, d.step) == ("nan", True, 23)


def test_preemption_by_sigterm():
    for exitcode, sig in ((-15, None), (143, None), (None, signal.SIGTERM)):
        assert classify(exitcode, sig, LOG_STEPS).kind == "preempted", (exitcode, sig)


def test_config_error_is_not_curable():
    log = "error: 1 problem(s) in the configuration:\n  - parallel.tp: 3 does not divide n_heads 4\n"
    for exitcode in (2, 1):
        d = classify(exitcode, None, log)
        assert (d.kind, d.curable) == ("config_error", False)
        assert d.detail == "error: 1 problem(s) in the configuration:"
    assert classify(2, None, "").kind == "config_error"


def test_unknown_failures_name_what_is_known():
    assert classify(1, None, "") == Diagnosis("unknown", True, "exit code 1", None)
    assert classify(-11, None, LOG_STEPS).detail == "killed by SIGSEGV"
    d = classify(1, None, "[default0]:error: no tokenised shards in data/cache: run prepare-data first\n")
    assert (d.kind, d.detail) == (
        "unknown",
        "error: no tokenised shards in data/cache: run prepare-data first",
    )


def test_root_cause_prefers_the_rank_that_failed_by_itself_over_peers_that_lost_it():
    lost = classify(1, None, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:123")
    bare = classify(1, None, "")
    killed = classify(-9, None, LOG_STEPS)
    # The agent saw the peers first (earlier time stamps); the killed rank is still the cause.
    assert root_cause([(1.0, 0, lost), (1.1, 2, bare), (1.2, 1, killed)]) == (1, killed)
    hang = classify(HANG_EXIT_CODE, None, "")
    assert root_cause([(2.0, 3, hang), (1.0, 1, killed)]) == (1, killed)  # two causes: the earlier one
    assert root_cause([(1.5, 1, lost), (1.0, 0, bare)]) == (0, bare)  # no cause of its own: the earliest
    with pytest.raises(ValueError):
        root_cause([])


def test_parse_step_takes_the_last_step_named():
    assert parse_step(LOG_STEPS) == 20
    assert parse_step(LOG_STEPS + "RuntimeError: diverged at step 27\n") == 27
    assert parse_step("no step here; stepping 5/6 is not a step") is None


def _exc(message: str, step: int | None) -> Diagnosis:
    return Diagnosis("user_exception", True, f"RuntimeError: {message}", step)


def test_policy_restarts_until_used_up():
    policy = RestartPolicy(max_restarts=2)
    assert policy.decide(_exc("a", 1))[0]
    assert policy.decide(_exc("b", 1))[0]
    restart, reason = policy.decide(_exc("c", 1))
    assert not restart and "used up (2 of 2)" in reason
    assert RestartPolicy(max_restarts=0).decide(_exc("a", 1))[0] is False


def test_policy_stops_on_what_a_restart_cannot_cure():
    restart, reason = RestartPolicy(5).decide(Diagnosis("config_error", False, "1 problem(s)", None))
    assert not restart and "not curable" in reason


def test_policy_stops_when_the_same_exception_recurs_at_the_same_step():
    policy = RestartPolicy(max_restarts=10)
    assert policy.decide(_exc("bad index", 40))[0]
    assert policy.decide(_exc("bad index", 41))[0]  # another step: could be chance
    assert policy.decide(_exc("other", 40))[0]  # another message at the same step
    restart, reason = policy.decide(_exc("bad index", 40))
    assert not restart and "deterministic" in reason and "step 40" in reason
    assert policy.restarts == 3
    assert policy.decide(_exc("no grad for <Tensor at 0x7f3a01>", 7))[0]
    assert not policy.decide(_exc("no grad for <Tensor at 0x55d2ff>", 7))[
        0
    ]  # the same error, another address


def test_policy_keeps_restarting_repeated_timeouts_and_unknown_steps():
    policy = RestartPolicy(max_restarts=3)
    timeout = Diagnosis("collective_timeout", True, "Connection closed by peer", 40)
    assert [policy.decide(timeout)[0] for _ in range(4)] == [True, True, True, False]
    policy = RestartPolicy(max_restarts=3)
    assert [policy.decide(_exc("x", None))[0] for _ in range(3)] == [True, True, True]


def test_read_error_file_in_torch_elastic_format(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise ValueError("bad batch at step 9")
    except ValueError as e:
        ErrorHandler().record_exception(e)  # what @record writes for an uncaught exception in a worker
    text = read_error_file(path)
    assert text.startswith("Traceback (most recent call last):")
    d = classify(1, None, text)
    assert (d.kind, d.detail, d.step) == ("user_exception", "ValueError: bad batch at step 9", 9)

    path.write_text(json.dumps({"message": "Signal 9 (SIGKILL) received by PID 12", "timestamp": 1}))
    assert read_error_file(path) == "Signal 9 (SIGKILL) received by PID 12"
    path.write_text("{not json")
    assert read_error_file(path) == ""
    assert read_error_file(tmp_path / "missing.json") == ""


def test_tail_reads_the_last_lines_of_a_large_file(tmp_path):
    path = tmp_path / "worker.log"
    path.write_text("".join(f"line {i}\n" for i in range(20000)))
    assert tail(path, 3) == "line 19997\nline 19998\nline 19999\n"
    assert tail(path, 1) == "line 19999\n"
    assert tail(path, 0) == ""
    path.write_text("a\nb\nc")  # no final newline
    assert tail(path, 2) == "b\nc"
    assert tail(path, 10) == "a\nb\nc"
    assert tail(tmp_path / "missing.log", 5) == ""


def test_a_rank_that_lost_its_peer_lingers_so_the_agent_blames_the_peer(monkeypatch):
    # The agent reports the first worker it finds dead: the rank whose collective broke must not exit first.
    import signal
    import time

    from scaletrain import launch

    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setenv("LOCAL_RANK", "0")
    previous = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, lambda *_: None)  # the trainer's preemption handler
        launch._linger_if_a_peer_failed("ValueError: bad value in user code")
        assert slept == [] and signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        launch._linger_if_a_peer_failed("RuntimeError: [pair.cc:537] Read error: Connection reset by peer.")
        assert (
            slept == [launch.LINGER_S] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        )  # the agent's stop ends it
        monkeypatch.delenv("LOCAL_RANK")
        # No agent: nobody to wait for.
        launch._linger_if_a_peer_failed("RuntimeError: Connection reset by peer")
        assert slept == [launch.LINGER_S]
    finally:
        signal.signal(signal.SIGTERM, previous)
