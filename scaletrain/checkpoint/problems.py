"""What checkpointing needs of the config and of the places it writes, checked before any work starts (validate
composes these): the checkpoint.* knobs, a storage root that takes a file, and a run directory whose earlier run is
continued from a committed checkpoint, never overwritten."""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

import fsspec

from scaletrain.checkpoint.manager import has_committed_checkpoint
from scaletrain.config import CheckpointConfig, RunConfig
from scaletrain.run.directory import RunDir


def checkpoint_problems(c: CheckpointConfig) -> list[str]:
    """checkpoint.* on their own: intervals, retention, the failure rate and the memory tier's figures."""
    problems = []
    if isinstance(c.interval, int) and c.interval < 0:
        problems.append("checkpoint.interval must be >= 0 (0: only at the end and on SIGTERM) or 'auto'")
    if c.keep_last < 0 or c.keep_every < 0:
        problems.append("checkpoint.keep_last and checkpoint.keep_every must be >= 0")
    if c.mtbf_hours <= 0:
        problems.append("checkpoint.mtbf_hours must be > 0")
    if min(c.snapshot_interval, c.snapshot_ttl_hours) < 0:
        problems.append("checkpoint.snapshot_interval and checkpoint.snapshot_ttl_hours must be >= 0")
    return problems


def saving_problems(c: CheckpointConfig, check_storage: bool) -> list[str]:
    """checkpoint.interval_minutes, and whether checkpoint.storage takes a file (checked where the run directory
    is: by the launcher, or the first rank of a first attempt). An unwritable storage used to be found at the final
    save, after all the training."""
    problems = []
    if not c.interval_minutes >= 0:
        problems.append("checkpoint.interval_minutes must be >= 0 (0: no time bound between saves)")
    if check_storage and c.enabled and c.storage:
        problems += [p for p in [storage_write_problem(c.storage)] if p]
    return problems


def storage_write_problem(location: str) -> str | None:
    """Why a file cannot be written at a checkpoint storage root (a local path or an fsspec URL), else None. A probe
    file is written and removed; a local root that does not exist yet is checked where it would be created."""
    fix = "fix its permissions (or credentials), or choose another --checkpoint.storage (empty: <run.dir>/checkpoints)"
    try:
        if "://" in location:
            fs, root = fsspec.core.url_to_fs(location)
            fs.makedirs(root, exist_ok=True)
            probe = f"{root.rstrip('/')}/.scaletrain-write-probe-{uuid.uuid4().hex}"
            fs.pipe_file(probe, b"probe")
            fs.rm(probe)
            return None
        ancestor = Path(location)
        while not ancestor.exists():
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            return f"checkpoint.storage '{location}' cannot be created: '{ancestor}' is a file; {fix}"
        with tempfile.TemporaryFile(dir=ancestor) as f:
            f.write(b"probe")
            f.flush()
    except Exception as e:  # fsspec backends raise their own (PermissionError, botocore's ClientError, ...)
        return f"checkpoint.storage '{location}' is not writable ({type(e).__name__}: {e}); {fix}"
    return None


def run_dir_problems(r: RunConfig, c: CheckpointConfig, heals: bool = False) -> list[str]:
    """run.dir: a directory that can be written, and a run there that trained is continued from a checkpoint or
    started over, never overwritten. `heals`: a fault-tolerant replica group g > 0 started again heals from a live
    peer and never reads the checkpoints."""
    if not r.dir:
        return []
    run = RunDir.at(r.dir)
    path = run.path
    # A run counts once it started training: a start that failed before (bad data, say) blocks nothing.
    if run.started() and not r.start_over and not heals:
        saved = c.enabled and run.run_id() is not None and has_committed_checkpoint(run.checkpoint_root(c))
        if not saved and c.snapshot_interval == 0:
            return [
                f"run.dir '{r.dir}' already holds a run that trained but has no committed checkpoint to continue from; it "
                "is never overwritten: choose a new --run.dir, or add --run.start_over true to train it again "
                "from step 0 (its records are kept)"
            ]
    if path.exists() and not path.is_dir():
        return [f"run.dir '{r.dir}' is a file, not a directory; choose another --run.dir"]
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return [f"run.dir '{r.dir}' cannot be created: '{ancestor}' is a file; choose another --run.dir"]
    try:
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as e:
        return [f"run.dir '{r.dir}' is not writable ({e.strerror} in '{ancestor}'); choose another --run.dir"]
    return []
