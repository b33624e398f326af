"""Shared by the end-to-end tests: run the real CLI in a subprocess and read what it wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "configs" / "debug.toml")
# Small and fast: a few steps of the debug model, no progress bar, one thread per process.
QUICK = ["--metrics.progress", "false", "--metrics.tensorboard", "false", "--training.threads", "1"]


def run_cli(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "scaletrain", *args]
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=os.environ.copy()
    ) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # A stuck run: ask it for every thread's stack (the CLI dumps them on SIGUSR1) so the failure says where.
            p.send_signal(signal.SIGUSR1)
            time.sleep(3)
            p.kill()
            out, err = p.communicate()
            raise AssertionError(
                f"timed out after {timeout} s: {' '.join(args)}\nstdout:\n{out}\nstderr:\n{err}"
            ) from None
    proc = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
