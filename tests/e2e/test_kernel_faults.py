"""Faults raised by the kernel, as a user meets them (issue 21): a small /dev/shm (Docker's default is 64 MiB; here a
tmpfs smaller than the debug model's snapshot, mounted in a private mount namespace), a read-only checkpoint
storage, and a file size limit (RLIMIT_FSIZE) that makes every large write fail. The real CLI, the debug config."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys

import pytest

from tests.helpers import DEBUG, QUICK, ROOT, events, run_cli

FAST = [*QUICK, "--training.eval_interval", "0", "--training.steps", "6"]


def _namespaces() -> str | None:
    """Why mounts in a private namespace cannot be tested here, or None when they can."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "true"], capture_output=True, text=True
    )
    return None if probe.returncode == 0 else f"unshare -m fails here: {probe.stderr.strip()}"


needs_mounts = pytest.mark.skipif(_namespaces() is not None, reason=str(_namespaces()))


def _train(*args: str, mount: str = "", preexec_fn=None) -> subprocess.CompletedProcess:
    """`scaletrain train --config configs/debug.toml ...` from the project root; `mount`: a shell command run first
    in a private mount namespace of the run's own (nothing outside it sees the mount)."""
    cmd = [sys.executable, "-m", "scaletrain", "train", "--config", DEBUG, *FAST, *args]
    if mount:
        script = f'{mount} && exec "$@"'
        cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *cmd]
    return subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=preexec_fn,
        env=os.environ.copy(),
    )


def _committed(run) -> list[int]:
    root = run / "checkpoints"
    return sorted(int(d.name[5:]) for d in root.glob("step-*") if (d / "commit.json").is_file())


@needs_mounts
def test_a_dev_shm_smaller_than_a_snapshot_turns_the_memory_tier_off_and_the_run_saves(tmp_path):
    """A 2 MiB /dev/shm cannot hold even the debug model's weights (3.1 MiB; a snapshot with AdamW is 9.4 MiB): the
    tier turns itself off before step 1 with a warning and an event, and the run trains and commits its final
    storage checkpoint. Before issue 21 the first snapshot's SafetensorError (ENOSPC) killed the run at step 3."""
    run = tmp_path / "run"
    p = _train("--run.dir", str(run), "--checkpoint.snapshot_interval", "3",
               mount="mount -t tmpfs -o size=2m tmpfs /dev/shm")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    off = events(run, "memory_tier_off")
    assert len(off) == 1 and off[0]["step"] == 1, off
    assert "/dev/shm" in off[0]["reason"] and "free" in off[0]["reason"]
    assert "memory tier off" in p.stderr and "/dev/shm" in p.stderr
    assert events(run, "memory_snapshot") == []
    assert _committed(run) == [6]
    assert [e["step"] for e in events(run, "checkpoint_saved")] == [6]


@needs_mounts
def test_a_dev_shm_that_fills_up_turns_the_tier_off_at_the_next_snapshot_and_the_run_saves(tmp_path):
    """12 MiB hold one snapshot (9.4 MiB) but not the next beside it (the previous one is kept until the new one
    is complete): the first snapshot is taken, the second finds no room, the tier turns off there, and the final
    storage save still happens (it used to snapshot to memory first and die)."""
    run = tmp_path / "run"
    p = _train("--run.dir", str(run), "--checkpoint.snapshot_interval", "2",
               mount="mount -t tmpfs -o size=12m tmpfs /dev/shm")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    assert [e["step"] for e in events(run, "memory_snapshot")] == [2]
    off = events(run, "memory_tier_off")
    assert [e["step"] for e in off] == [4], off
    assert _committed(run) == [6]


@needs_mounts
def test_a_read_only_checkpoint_storage_is_refused_before_any_step(tmp_path):
    """checkpoint.storage on a read-only mount (root ignores permission bits, not a read-only filesystem): the
    start is refused with the location named and what to change, before any step (it used to train to the end
    and fail at the final save)."""
    storage, run = tmp_path / "storage", tmp_path / "run"
    storage.mkdir()
    p = _train("--run.dir", str(run), "--checkpoint.storage", str(storage),
               mount=f"mount -t tmpfs -o ro,size=1m tmpfs {storage}")  # fmt: skip
    assert p.returncode != 0
    assert f"checkpoint.storage '{storage}'" in p.stderr and "not writable" in p.stderr, p.stderr
    assert "Read-only file system" in p.stderr
    assert not (run / "metrics.jsonl").exists()


def test_a_checkpoint_storage_below_a_file_is_refused_before_any_step(tmp_path):
    """The same without root: a storage path that runs into a file."""
    (tmp_path / "file").write_text("not a directory")
    run = tmp_path / "run"
    p = _train("--run.dir", str(run), "--checkpoint.storage", str(tmp_path / "file" / "ckpt"))
    assert p.returncode != 0
    assert f"checkpoint.storage '{tmp_path / 'file' / 'ckpt'}'" in p.stderr, p.stderr
    assert "is a file" in p.stderr
    assert not (run / "metrics.jsonl").exists()


def _limit_file_size() -> None:
    # 1 MiB: the run's records (config, metrics, events) fit; a checkpoint shard or a snapshot (9.4 MiB) does not.
    # Python ignores SIGXFSZ, so a write past the limit fails with EFBIG instead of killing the process.
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def test_a_file_size_limit_fails_every_save_cleanly(tmp_path):
    """RLIMIT_FSIZE: the kernel fails every large write with EFBIG. The memory tier turns off at its first
    snapshot, each periodic storage save is reported (checkpoint_failed) and training goes on, and the failed final
    save ends the run with an error that says nothing was saved, without a traceback. Before issue 21 the tier's
    SafetensorError (not an OSError) escaped at step 2 with a traceback."""
    run_cli(
        "prepare-data", "--config", DEBUG
    )  # the tokenised data (22 MiB) is written before the limit applies
    run = tmp_path / "run"
    p = _train("--run.dir", str(run), "--checkpoint.snapshot_interval", "2", "--checkpoint.interval", "3",
               preexec_fn=_limit_file_size)  # fmt: skip
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr
    assert "the final checkpoint of step 6 failed" in p.stderr and "nothing saved" in p.stderr
    off = events(run, "memory_tier_off")
    assert [e["step"] for e in off] == [2] and "File too large" in off[0]["reason"], off
    assert [e["step"] for e in events(run, "checkpoint_failed")] == [3, 6]
    assert _committed(run) == []
