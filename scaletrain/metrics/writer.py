"""Rank 0's run records: `metrics.jsonl` (one line per logged step), `events.jsonl`, and the same metrics and
events in TensorBoard and (metrics.wandb_project) Weights & Biases; the checks of metrics.* (metrics_problems).

A record that cannot be written (a full disk, a quota, a W&B login missing) is dropped and counted, with one
warning: the run's log must never end the run it logs, nor leave a half line that breaks the lines after it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from scaletrain.config import MetricsConfig
from scaletrain.run.directory import CONFIG, EVENTS, METRICS, RUN_ID

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

log = logging.getLogger("scaletrain")

# Lines lost to failed writes, by file, for this process; the files failing right now (warned about once). A
# process-wide tally because any rank and the launcher append events through append_event.
_DROPPED: dict[str, int] = {}
_FAILING: set[str] = set()
_LOCK = threading.Lock()  # the watchdog thread appends events too


def _jsonable(value: Any) -> Any:
    """Plain JSON types for tensors, numpy scalars, paths and containers; NaN and ±inf become null.

    Non-finite numbers are written as null so every line stays strict JSON (Python's json would write the bare
    token NaN, which jq and most other readers reject). TensorBoard still receives the raw value.
    """
    if isinstance(value, torch.Tensor):
        value = value.item()
    elif hasattr(value, "item") and callable(value.item):  # numpy scalars and 0-d arrays
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return str(value)  # paths, enums, devices: their printed form is what a reader wants


def append_event(run_dir: Path, kind: str, step: int | None, **fields: Any) -> bool:
    """Append one `{"time", "kind", "step", ...}` line to <run_dir>/events.jsonl: the one writer of events, used by
    rank 0's MetricsWriter and by any rank that must report itself (a hang, a fault on rank 3, the launcher).

    One write(2) on an O_APPEND descriptor (append_line): lines of concurrent writers (ranks, processes) land whole,
    one after another, and a crash right after loses nothing already written. A full disk drops the line (False),
    counted, and never raises."""
    if "time" in fields:
        raise ValueError("event fields must not contain 'time'; the writer stamps it")
    record = {"time": time.time(), "kind": kind, "step": step, **{k: _jsonable(v) for k, v in fields.items()}}
    return append_line(Path(run_dir) / EVENTS, json.dumps(record, allow_nan=False) + "\n")


def append_line(path: Path, line: str) -> bool:
    """Append one whole line to `path` with one write(2) on an O_APPEND descriptor; False when it was dropped.

    O_APPEND and a single write make lines of concurrent writers land whole, one after another. A failed write
    (ENOSPC, EDQUOT, EIO) drops the line: warned about once per outage, counted (dropped_lines), and the run goes
    on. A short write (the disk filled mid-line) is cut back off the file, so the next line starts a line of its
    own and every reader still parses every line."""
    data = line.encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        return _dropped(path, e)
    error: OSError | None = None
    try:
        # A last line left without its newline (a writer killed mid-line, a short write that could not be cut
        # back) is closed first, so this record starts a line of its own instead of being lost with the fragment.
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        written = os.write(fd, data)
        if written != len(data):
            _cut_back(fd, written)
            error = OSError(f"only {written} of {len(data)} bytes written (is the disk full?)")
    except OSError as e:
        error = e
    try:
        os.close(fd)
    except OSError as e:  # NFS may report a failed write only at close
        error = error or e
    if error is not None:
        return _dropped(path, error)
    _written(path)
    return True


def _cut_back(fd: int, written: int) -> None:
    """Remove the `written` bytes of a short write from the end of the file, unless another writer has appended
    since (then the fragment stays, and readers that skip unparsable lines pass over it)."""
    end = os.lseek(fd, 0, os.SEEK_CUR)  # O_APPEND: the end of what this write put there
    if os.fstat(fd).st_size == end:
        os.ftruncate(fd, end - written)


def _dropped(path: Path, error: OSError) -> bool:
    key = str(path)
    with _LOCK:
        _DROPPED[key] = _DROPPED.get(key, 0) + 1
        first = key not in _FAILING
        _FAILING.add(key)
    if first:
        log.warning(
            "could not write to %s (%s): training goes on, and its lines are dropped (and counted) until writes "
            "succeed again; free space on that disk to keep them",
            path,
            error,
        )
    return False


def _written(path: Path) -> None:
    key = str(path)
    if key in _FAILING:
        with _LOCK:
            _FAILING.discard(key)
        log.warning("writing to %s again; %d line(s) were dropped so far", path, _DROPPED[key])


def dropped_lines(path: Path) -> int:
    """How many lines this process could not append to `path`."""
    return _DROPPED.get(str(path), 0)


def wandb_problem(project: str) -> str | None:
    """The problem with metrics.wandb_project = `project` (said before launch), None when there is none: wandb is
    an optional dependency, found here without importing it."""
    if project and importlib.util.find_spec("wandb") is None:
        return (
            f"metrics.wandb_project = {project!r} needs Weights & Biases, which is not installed: pip install "
            "wandb, or unset metrics.wandb_project"
        )
    return None


class MetricsWriter:
    """Appends metrics and events as JSON lines under `run_dir`, and hands them to TensorBoard and W&B when asked;
    a disabled writer (ranks > 0) writes nothing."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool, wandb_project: str = "") -> None:
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.tensorboard = tensorboard
        self.wandb_project = wandb_project
        self.dropped: dict[str, int] = {}
        """Lines of each file (metrics.jsonl, events.jsonl) this writer could not write."""
        self.last_event = ""
        """The newest event, "kind (step N)", for the progress display."""
        self._reported: dict[str, int] = {}
        # SummaryWriter and the W&B run, made on first use so that only runs using them pay for the import.
        self._tb: Any = None
        self._wandb: Any = None
        self._sinks = threading.Lock()  # a checkpoint's commit thread writes its event too

    def log(self, step: int, values: dict[str, float]) -> None:
        """Append `{"step": step, "time": now, **values}` to metrics.jsonl, and each number to TensorBoard and W&B.
        `time` (wall clock, as events have it) places the record among the events: goodput needs it to know which
        steps a record's window covers when a fault-tolerant group healed forward between two records."""
        if not self.enabled:
            return
        if "step" in values or "time" in values:
            raise ValueError("values must not contain 'step' or 'time'; the writer adds them")
        record = {"step": int(step), "time": time.time(), **{k: _jsonable(v) for k, v in values.items()}}
        self._append(METRICS, record)
        numbers = _numbers(values)
        self._to_sinks(partial(_tb_scalars, int(step), numbers), partial(_wandb_scalars, int(step), numbers))

    def event(self, kind: str, step: int | None = None, **fields: Any) -> None:
        """Append `{"time", "kind", "step", **fields}` to events.jsonl (checkpoint, restart, fault, ...)."""
        if not self.enabled:
            return
        if not append_event(self.run_dir, kind, step, **fields):
            self.dropped[EVENTS] = self.dropped.get(EVENTS, 0) + 1
        self.last_event = kind if step is None else f"{kind} (step {step})"
        self._to_sinks(partial(_tb_event, kind, step, fields), partial(_wandb_event, kind, step, fields))

    def close(self) -> None:
        """Flush TensorBoard and report lines that were dropped; a later log or event still writes."""
        for name, n in self.dropped.items():
            if self._reported.get(name) != n:  # close() may run more than once
                log.warning(
                    "%d line(s) of %s could not be written (see the warning above)", n, self.run_dir / name
                )
        self._reported = dict(self.dropped)
        with self._sinks:
            if self._tb is not None:
                try:
                    self._tb.close()
                except OSError as e:
                    log.warning(
                        "could not flush TensorBoard scalars to %s (%s)", self.run_dir / "tensorboard", e
                    )
                self._tb = None
            if self._wandb is not None:
                try:
                    self._wandb.finish()
                except Exception as e:  # W&B's own failures (network, service) must not fail the run's end
                    log.warning("could not finish the W&B run (%s)", e)
                self._wandb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _append(self, name: str, record: dict[str, Any]) -> None:
        # Written through to the OS at once, line by line: a crash loses nothing already logged.
        if not append_line(self.run_dir / name, json.dumps(record, allow_nan=False) + "\n"):
            self.dropped[name] = self.dropped.get(name, 0) + 1

    def _to_sinks(self, to_tb: Callable[[Any], object], to_wandb: Callable[[Any], object]) -> None:
        """Hand a record to TensorBoard and W&B (those on); a sink that fails is warned about and turned off, and
        metrics.jsonl and events.jsonl keep everything."""
        with self._sinks:
            if self.tensorboard:
                try:
                    to_tb(self._tensorboard())
                except OSError as e:  # its writer thread re-raises a failed write (a full disk) here
                    log.warning(
                        "could not write TensorBoard scalars to %s (%s); TensorBoard is off for the rest of the "
                        "run, metrics.jsonl keeps every step",
                        self.run_dir / "tensorboard",
                        e,
                    )
                    self.tensorboard = False
            if self.wandb_project:
                try:
                    to_wandb(self._wandb_run())
                except Exception as e:  # no login, no network, a service crash: W&B's own, of any type
                    log.warning(
                        "could not log to Weights & Biases (%s); W&B is off for the rest of the run (log in with "
                        "`wandb login`, or set WANDB_MODE=offline), metrics.jsonl keeps every step",
                        e,
                    )
                    self.wandb_project = ""

    def _tensorboard(self) -> Any:
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: slow, so only when used

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        return self._tb

    def _wandb_run(self) -> Any:
        """The W&B run: named after the run directory, with its resolved config, and resumed by the run's id, so
        every restart of the job logs into the same W&B run."""
        if self._wandb is None:
            import wandb  # optional: validate() refused the config without it

            config, id_file = self.run_dir / CONFIG, self.run_dir / RUN_ID
            self._wandb = wandb.init(
                project=self.wandb_project,
                name=self.run_dir.name,
                id=id_file.read_text().strip() if id_file.is_file() else None,
                resume="allow",
                config=tomllib.loads(config.read_text()) if config.is_file() else {},
                dir=os.environ.get("WANDB_DIR") or str(self.run_dir),
                settings=wandb.Settings(
                    console="off"
                ),  # the console stays ours (the progress bar, log lines)
            )
            # Steps go back after a rollback or a resume, which W&B's own step may not: plot against ours.
            self._wandb.define_metric("step")
            self._wandb.define_metric("*", step_metric="step")
        return self._wandb


def _numbers(values: dict[str, Any]) -> dict[str, float]:
    """The numeric entries (tensors and numpy scalars unwrapped; bools, strings and None left out)."""
    out = {}
    for key, value in values.items():
        scalar = value.item() if hasattr(value, "item") and callable(value.item) else value
        if isinstance(scalar, int | float) and not isinstance(scalar, bool):
            out[key] = scalar
    return out


def _tb_scalars(step: int, numbers: dict[str, float], tb: Any) -> None:
    for key, value in numbers.items():
        tb.add_scalar(key, value, step)


def _wandb_scalars(step: int, numbers: dict[str, float], run: Any) -> None:
    run.log({"step": step, **numbers})


def _tb_event(kind: str, step: int | None, fields: dict[str, Any], tb: Any) -> None:
    """An event in TensorBoard: a text entry under events/<kind> and each numeric field as events/<kind>/<field>."""
    text = ", ".join(f"{k}={_jsonable(v)}" for k, v in fields.items()) or kind
    tb.add_text(f"events/{kind}", text, step)
    for key, value in _numbers(fields).items():
        tb.add_scalar(f"events/{kind}/{key}", value, step)


def _wandb_event(kind: str, step: int | None, fields: dict[str, Any], run: Any) -> None:
    """An event in W&B: a marker events/<kind> = 1 at its step with its numeric fields; the end's into the summary."""
    numbers = {f"events/{kind}/{k}": v for k, v in _numbers(fields).items()}
    run.log({**({} if step is None else {"step": step}), f"events/{kind}": 1, **numbers})
    if kind == "end":
        run.summary.update(_numbers(fields))


def metrics_problems(m: MetricsConfig) -> list[str]:
    """metrics.*: the log interval, the W&B project, the samples' settings."""
    problems = [] if m.log_interval >= 1 else ["metrics.log_interval must be >= 1"]
    problems += [p for p in [wandb_problem(m.wandb_project)] if p]
    if not m.sample_temperature >= 0:
        problems.append(f"metrics.sample_temperature {m.sample_temperature} must be >= 0 (0: greedy)")
    if m.sample_top_k < 0:
        problems.append(f"metrics.sample_top_k {m.sample_top_k} must be >= 0 (0: the whole vocabulary)")
    if m.sample_count < 1:
        problems.append(
            f'metrics.sample_count {m.sample_count} must be >= 1 (no samples: metrics.sample_prompt "")'
        )
    return problems
