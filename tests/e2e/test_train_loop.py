"""The loop's contracts that broke by reading (each failed before the architecture refactor): a skipped step on a
save step resumes exactly, a kill during the final save loses nothing, SIGTERM is honoured with checkpoints
disabled. (A write failure inside DCP is survived: test_resilience.py's failing save, both save modes in
tests/unit/test_checkpoint.py.)"""

import signal
import subprocess
import sys
import time

from tests.helpers import ROOT, events, per_step, read_jsonl, train_args, train_cli

BASE = dict(training__eval_interval=0, metrics__log_interval=1)


def _inject(*tables: str) -> str:
    return "--resilience.inject=[" + ", ".join(tables) + "]"


def test_a_skipped_step_on_a_save_step_resumes_exactly(tmp_path):
    """Step 4 is skipped (NaN) and saved. The checkpoint must say step 4 with the loader past batch 4: a resumed
    run then continues with batch 5, bit for bit as the uninterrupted run (it used to store step 3 with the loader
    past batch 4, so the resumed run was shifted by one batch)."""
    args = dict(
        BASE, training__deterministic=True, steps=8, checkpoint__interval=4, checkpoint__async_save=False
    )
    nan = '{kind="nan", step=4}'
    ref, run = tmp_path / "ref", tmp_path / "run"
    train_cli(ref, _inject(nan), **args)
    train_cli(run, "--max-restarts", "1", _inject(nan, '{kind="kill", rank=0, step=6}'), **args)
    (loaded,) = events(run, "checkpoint_loaded")
    assert loaded["step"] == 4 and events(run, "skipped_step")[0]["step"] == 4
    assert per_step(run, "loss") == per_step(ref, "loss")
    assert per_step(run, "grad_norm") == per_step(ref, "grad_norm")
    assert [e["step"] for e in events(run, "start")] == [0, 4]


def test_a_kill_during_the_final_save_resumes_from_the_memory_tier(tmp_path):
    """The final save is protected: the memory tier holds a snapshot of the last step until the storage
    checkpoint is committed. Killed inside the storage writer of the final save, the restarted job resumes from
    memory at the last step and commits the final checkpoint (it used to delete the snapshots first and lose the
    whole run with checkpoint.interval = 0)."""
    run = tmp_path / "run"
    train_cli(
        run,
        "--max-restarts",
        "1",
        _inject('{kind="kill_during_save", step=8}'),
        steps=8,
        **BASE,
        checkpoint__snapshot_interval=3,
    )
    [failure] = events(run, "failure")
    assert failure["cause"] == "killed"
    loaded = events(run, "checkpoint_loaded")
    assert [(e["step"], e["source"]) for e in loaded] == [(8, "memory")]
    assert [e["step"] for e in events(run, "checkpoint_saved")] == [8]
    assert (run / "checkpoints" / "step-00000008" / "commit.json").exists()


def test_sigterm_with_checkpoints_disabled_stops_within_30_s(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "scaletrain",
            *train_args(run, steps=100000, **BASE, checkpoint__enabled=False),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").exists() or len(read_jsonl(run / "metrics.jsonl")) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 30 and proc.returncode == 0, err
    (pre,) = events(run, "preempted")
    assert events(run, "end")[0]["steps"] == pre["step"] < 100000
    assert not (run / "checkpoints").exists()
