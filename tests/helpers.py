"""Shared by the end-to-end tests: run the real CLI in a subprocess and read what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "configs" / "debug.toml")
# Small and fast: a few steps of the debug model, no progress bar, one thread per process.
QUICK = ["--metrics.progress", "false", "--metrics.tensorboard", "false", "--training.threads", "1"]


def run_cli(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "scaletrain", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=os.environ.copy())
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
