"""Rank 0's run records: `metrics.jsonl` (one line per logged step), `events.jsonl`, and TensorBoard scalars.

A record that cannot be written (a full disk, a quota) is dropped and counted, with one warning: the run's log
must never end the run it logs, nor leave a half line that breaks the lines after it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

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
    return append_line(Path(run_dir) / "events.jsonl", json.dumps(record, allow_nan=False) + "\n")


def append_line(path: Path, line: str) -> bool:
    """Append one whole line to `path` with one write(2) on an O_APPEND descriptor; False when it was dropped.

    O_APPEND and a single write make lines of concurrent writers land whole, one after another. A failed write
    (ENOSPC, EDQUOT, EIO) drops the line: warned about once per outage, counted (dropped_lines), and the run goes
    on. A short write (the disk filled mid-line) is cut back off the file, so the next line starts a line of its
    own and every reader still parses every line."""
    data = line.encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        return _dropped(path, e)
    error: OSError | None = None
    try:
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


class MetricsWriter:
    """Appends metrics and events as JSON lines under `run_dir`; a disabled writer (ranks > 0) writes nothing."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool) -> None:
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.tensorboard = tensorboard
        self.dropped: dict[str, int] = {}
        """Lines of each file (metrics.jsonl, events.jsonl) this writer could not write."""
        self._reported: dict[str, int] = {}
        # SummaryWriter, created on the first log so that only runs using it pay for importing tensorboard.
        self._tb: Any = None

    def log(self, step: int, values: dict[str, float]) -> None:
        """Append `{"step": step, **values}` to metrics.jsonl and each number as a TensorBoard scalar."""
        if not self.enabled:
            return
        if "step" in values:
            raise ValueError("values must not contain 'step'; it is passed as its own argument")
        record = {"step": int(step), **{k: _jsonable(v) for k, v in values.items()}}
        self._append("metrics.jsonl", record)
        if self.tensorboard:
            try:
                self._log_tensorboard(int(step), values)
            except OSError as e:  # its writer thread re-raises a failed write (a full disk) here
                log.warning(
                    "could not write TensorBoard scalars to %s (%s); TensorBoard is off for the rest of the run, "
                    "metrics.jsonl keeps every step",
                    self.run_dir / "tensorboard",
                    e,
                )
                self.tensorboard = False

    def event(self, kind: str, step: int | None = None, **fields: Any) -> None:
        """Append `{"time", "kind", "step", **fields}` to events.jsonl (checkpoint, restart, fault, ...)."""
        if not self.enabled:
            return
        if not append_event(self.run_dir, kind, step, **fields):
            self.dropped["events.jsonl"] = self.dropped.get("events.jsonl", 0) + 1

    def close(self) -> None:
        """Flush TensorBoard and report lines that were dropped; a later log or event still writes."""
        for name, n in self.dropped.items():
            if self._reported.get(name) != n:  # close() may run more than once
                log.warning(
                    "%d line(s) of %s could not be written (see the warning above)", n, self.run_dir / name
                )
        self._reported = dict(self.dropped)
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError as e:
                log.warning("could not flush TensorBoard scalars to %s (%s)", self.run_dir / "tensorboard", e)
            self._tb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _append(self, name: str, record: dict[str, Any]) -> None:
        # Written through to the OS at once, line by line: a crash loses nothing already logged.
        if not append_line(self.run_dir / name, json.dumps(record, allow_nan=False) + "\n"):
            self.dropped[name] = self.dropped.get(name, 0) + 1

    def _log_tensorboard(self, step: int, values: dict[str, float]) -> None:
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: slow, so only when used

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        for key, value in values.items():
            scalar = value.item() if hasattr(value, "item") else value
            if isinstance(scalar, int | float) and not isinstance(scalar, bool):
                self._tb.add_scalar(key, scalar, step)
