"""Shared by the tests: run the real CLI in a subprocess, read what a run wrote (metrics.jsonl, events.jsonl), and
pick a free port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "configs" / "debug.toml")
# Small and fast: a few steps of the debug model, no progress bar, one thread per process.
QUICK = ["--metrics.progress", "false", "--metrics.tensorboard", "false", "--training.threads", "1"]


def run_cli(
    *args: str, timeout: float = 300, check: bool = True, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    """`scaletrain ARGS` in a subprocess, from the checkout (or `cwd`: the user's own working directory)."""
    cmd = [sys.executable, "-m", "scaletrain", *args]
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=os.environ.copy()
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


def start_cli(*args: str, cwd: Path = ROOT, **popen: object) -> subprocess.Popen:
    """`scaletrain ARGS` started in the background (text pipes unless `popen` says otherwise), with Ctrl-C as a
    terminal's foreground job gets it: a suite started in the background of a non-interactive shell (as CI may be)
    inherits SIGINT ignored, which the process would keep."""
    kw: dict = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    return subprocess.Popen(
        [sys.executable, "-m", "scaletrain", *args], cwd=cwd,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **{**kw, **popen},
    )  # fmt: skip


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a JSON-lines file, in order (blank lines skipped)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def events(run: Path, kind: str | None = None) -> list[dict]:
    """The run's events (<run>/events.jsonl) in the order written, only those of `kind` when given."""
    return [e for e in read_jsonl(Path(run) / "events.jsonl") if kind is None or e["kind"] == kind]


def per_step(run: Path, key: str | tuple[str, ...]) -> dict[int, object]:
    """{step: value of `key`} from the run's metrics (<run>/metrics.jsonl); with a tuple of keys, {step: (values)}.

    A step recomputed after a resume overwrites its first record, so this is the history the run ended with. A
    value may be None (a non-finite loss is recorded as null)."""
    out: dict[int, object] = {}
    for m in read_jsonl(Path(run) / "metrics.jsonl"):
        out[m["step"]] = tuple(m[k] for k in key) if isinstance(key, tuple) else m[key]
    return out


def losses(run: Path) -> dict[int, float | None]:
    """{step: loss} of the run: `per_step(run, "loss")`."""
    return per_step(run, "loss")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a rendezvous or a process group's store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
