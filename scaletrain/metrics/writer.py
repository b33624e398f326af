"""Rank 0's run records: `metrics.jsonl` (one line per logged step), `events.jsonl`, and TensorBoard scalars."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import IO, Any

import torch


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


def append_event(run_dir: Path, kind: str, step: int | None, **fields: Any) -> None:
    """Append one `{"time", "kind", "step", ...}` line to <run_dir>/events.jsonl: the one writer of events, used by
    rank 0's MetricsWriter and by any rank that must report itself (a hang, a fault on rank 3, the launcher).

    One write(2) on an O_APPEND descriptor: lines of concurrent writers (ranks, processes) land whole, one after
    another, and a crash right after loses nothing already written."""
    if "time" in fields:
        raise ValueError("event fields must not contain 'time'; the writer stamps it")
    record = {"time": time.time(), "kind": kind, "step": step, **{k: _jsonable(v) for k, v in fields.items()}}
    line = json.dumps(record, allow_nan=False) + "\n"
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class MetricsWriter:
    """Appends metrics and events as JSON lines under `run_dir`; a disabled writer (ranks > 0) writes nothing."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool) -> None:
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.tensorboard = tensorboard
        self._files: dict[str, IO[str]] = {}
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
            self._log_tensorboard(int(step), values)

    def event(self, kind: str, step: int | None = None, **fields: Any) -> None:
        """Append `{"time", "kind", "step", **fields}` to events.jsonl (checkpoint, restart, fault, ...)."""
        if not self.enabled:
            return
        append_event(self.run_dir, kind, step, **fields)

    def close(self) -> None:
        """Close the files and flush TensorBoard; a later log or event reopens them in append mode."""
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _append(self, name: str, record: dict[str, Any]) -> None:
        f = self._files.get(name)
        if f is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            f = self._files[name] = open(self.run_dir / name, "a", encoding="utf-8")
        f.write(json.dumps(record, allow_nan=False) + "\n")
        # Flush every line: a crash then loses nothing already logged (the OS holds it even if we die).
        f.flush()

    def _log_tensorboard(self, step: int, values: dict[str, float]) -> None:
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: slow, so only when used

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        for key, value in values.items():
            scalar = value.item() if hasattr(value, "item") else value
            if isinstance(scalar, int | float) and not isinstance(scalar, bool):
                self._tb.add_scalar(key, scalar, step)
