"""Training runs started as subprocesses, for the commands that train several runs and compare them (parity,
bench): every run's config checked before the first starts, then each run and its per-step metrics."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from scaletrain.errors import ConfigError
from scaletrain.host import run_from_small_parent
from scaletrain.rundir import RunDir
from scaletrain.validate import load_config


def check_configs(config: str | None, runs: list[tuple[str, list[str], int]]) -> None:
    """Validate the whole config of every run before the first starts: (name, its overrides of `config`, world
    size) each. A bad variant or layout is refused with every problem of every run at once, named by run, instead
    of after minutes of the runs before it."""
    problems = []
    for name, overrides, world in runs:
        try:
            load_config(config, overrides, world_size=world, check_run_dir=False)
        except ConfigError as e:
            problems += [f"{name}: {p}" for p in e.problems]
    if problems:
        raise ConfigError(problems)


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
