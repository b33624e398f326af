"""Shared by the tests: run the real CLI in a subprocess (`train_cli` for a training run), read what a run wrote
(metrics.jsonl, events.jsonl), and pick a free port. (Objects the tests build in-process: tests/fixtures.py.)"""

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
# A fixed MFU peak (TFLOP/s per process, above any CPU's so MFU stays below 1): the suite runs under load, where a
# measured CPU peak is used for one run and never cached, so every rank of every run timed matmuls for a second
# (1.5-2 s of a 7.5 s two-rank run). The measured default keeps its CLI test
# (test_train_cli.py::test_single_process_run_writes_the_run_directory_contract) and its unit tests
# (tests/unit/test_mfu_truth.py).
FIXED_PEAK = ["--metrics.peak_tflops", "1"]
# Small and fast: a few steps of the debug model, no progress bar, one thread per process.
QUICK = [
    "--metrics.progress",
    "false",
    "--metrics.tensorboard",
    "false",
    "--training.threads",
    "1",
    *FIXED_PEAK,
]


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


def train_args(
    run: Path | str | None,
    *args: str,
    steps: int | None = None,
    nproc: int = 1,
    config: str = DEBUG,
    quick: bool = True,
    **overrides: object,
) -> list[str]:
    """The arguments of `scaletrain train --config CONFIG --run.dir RUN [--nproc N] [QUICK] [--training.steps S]
    ARGS OVERRIDES` (no --run.dir when `run` is None; --nproc only above 1).

    `args` go as they are (launcher flags such as --max-restarts, `--key=value` forms, a layout's list). Each
    override `section__key=value` becomes `--section.key value`, True/False as true/false:
    `train_args(run, steps=10, training__eval_interval=0)`. A key given twice on a command line takes its last
    value; here a dict of overrides says it once (`{**BASE, "steps": 6}`)."""
    flags = [
        a
        for key, value in overrides.items()
        for a in (
            f"--{key.replace('__', '.')}",
            str(value).lower() if isinstance(value, bool) else str(value),
        )
    ]
    return [
        "train",
        "--config",
        config,
        *(["--run.dir", str(run)] if run is not None else []),
        *(["--nproc", str(nproc)] if nproc != 1 else []),
        *(QUICK if quick else []),
        *(["--training.steps", str(steps)] if steps is not None else []),
        *args,
        *flags,
    ]


def train_cli(
    run: Path | str | None,
    *args: str,
    check: bool = True,
    timeout: float = 300,
    cwd: Path = ROOT,
    **kw: object,
) -> subprocess.CompletedProcess:
    """`scaletrain train` with `train_args(run, *args, **kw)` (steps, nproc, config, quick, section__key=value),
    through run_cli: the debug config, the run directory `run`, QUICK, unless told otherwise."""
    return run_cli(*train_args(run, *args, **kw), check=check, timeout=timeout, cwd=cwd)


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
