"""Training runs started as subprocesses, for the commands that train several runs and compare them (parity,
bench): each run and its per-step metrics. (validate.check_configs checks every run's config before the first.)"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from scaletrain.errors import ConfigError
from scaletrain.hardware import run_from_small_parent
from scaletrain.run.directory import RunDir


def run_train(args: list[str], nproc: int, run_dir: Path) -> list[dict]:
    """`scaletrain train --nproc N ARGS --run.dir RUN_DIR` in a subprocess; its metrics.jsonl records. Started
    from a bare interpreter so that the run's peak memory is its own (see run_from_small_parent); a failed run is a
    ConfigError with the tail of its stderr."""
    cmd = [
        sys.executable,
        "-m",
        "scaletrain",
        "train",
        "--nproc",
        str(nproc),
        *args,
        "--run.dir",
        str(run_dir),
    ]
    proc = run_from_small_parent(cmd, os.environ.copy(), capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise ConfigError(f"run failed ({' '.join(cmd[3:])}):\n{tail}")
    return RunDir(run_dir).read_metrics()
