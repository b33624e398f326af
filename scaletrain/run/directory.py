"""The run directory's one owner: where it is (resolved once, absolute), the names of its files, its JSONL records
(one reader, safe against a torn last line), and what a start finds there — a fresh directory, a run to continue,
a finished run, or one to refuse. A run counts as a run once it started training (its `start` event): a start that
failed before that leaves nothing that blocks the corrected command.

Without --run.dir the command picks the directory: the newest runs/<name>-<date>-<time>[-n] whose run has the same
resolved config (so typing the command again continues that run), else a new one (unique even when two runs start
in the same second)."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import tomli_w

from scaletrain.config import CheckpointConfig, translate_renamed
from scaletrain.config.io import absolute
from scaletrain.errors import STOPPED_EXIT_CODE
from scaletrain.run.resume import resume_problems

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIG = "config.toml"
RUN_ID = "run_id"
EVENTS = "events.jsonl"
METRICS = "metrics.jsonl"
SAMPLES = "samples.jsonl"
CHECKPOINTS = "checkpoints"
LOGS = "logs"
RUNS_ROOT = "runs"  # where runs without --run.dir go, under the working directory


def read_jsonl(path: str | Path, skipped: list[int] | None = None) -> list[dict[str, Any]]:
    """The JSON objects of a .jsonl file, [] when it does not exist. A line that is not a JSON object (a kill or a
    full disk can cut one short) is passed over; its line number goes to `skipped` when given, so a reader that
    shows the records can say what it left out."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                out.append(obj)
            elif skipped is not None:
                skipped.append(number)
    return out


def shown(path: Path) -> str:
    """A path as the working directory sees it: relative below it, else absolute."""
    return os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)


@dataclass(frozen=True)
class RunDir:
    path: Path

    @classmethod
    def at(cls, path: str | Path) -> RunDir:
        return cls(absolute(path))

    # -- its files ---------------------------------------------------------------------------------------------
    @property
    def config(self) -> Path:
        return self.path / CONFIG

    @property
    def events(self) -> Path:
        return self.path / EVENTS

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def samples(self) -> Path:
        """What the model wrote at the end of each start that trained to the end (metrics.sample_prompt)."""
        return self.path / SAMPLES

    @property
    def logs(self) -> Path:
        return self.path / LOGS

    def run_id(self) -> str | None:
        """The run's id (written at its first start; it keys the memory tier's snapshots), None before."""
        path = self.path / RUN_ID
        return path.read_text().strip() if path.is_file() else None

    def checkpoint_root(self, cfg: CheckpointConfig, run_id: str | None = None) -> str:
        """<run dir>/checkpoints, or <checkpoint.storage>/<run id>: a storage root shared by several runs holds
        one folder per run, so no run resumes from, or retention deletes, another's."""
        if not cfg.storage:
            return str(self.path / CHECKPOINTS)
        return f"{cfg.storage.rstrip('/')}/{run_id or self.run_id() or ''}"

    def read_events(self, skipped: list[int] | None = None) -> list[dict]:
        return read_jsonl(self.events, skipped)

    def read_metrics(self, skipped: list[int] | None = None) -> list[dict]:
        return read_jsonl(self.metrics, skipped)

    def read_samples(self, skipped: list[int] | None = None) -> list[dict]:
        return read_jsonl(self.samples, skipped)

    # -- what a start finds ------------------------------------------------------------------------------------
    def started(self) -> bool:
        """True once a start of this run reached training (wrote its `start` event, or metrics)."""
        return any(e.get("kind") == "start" for e in self.read_events()) or bool(self.read_metrics())

    def last_outcome(self) -> dict | None:
        """The last start's `end` event, None when the last start did not end (still running, or it crashed)."""
        last = None
        for e in self.read_events():
            if e.get("kind") in ("start", "end"):
                last = e
        return last if last is not None and last.get("kind") == "end" else None

    def exit_code(self) -> int:
        """The status the last start ended with, from its events: STOPPED_EXIT_CODE when its end event says it
        stopped early (run.time_limit, run.stop_at_step), else 0. For launchers whose workers exit 0 to an elastic
        agent (which takes any other status for a failure); a job script reads it without importing torch
        (examples/slurm)."""
        end = self.last_outcome()
        return STOPPED_EXIT_CODE if end is not None and end.get("stopped") else 0

    def ran_dry(self) -> dict | None:
        """The last start's end when data.when_dry = "stop" ended it at a source's end: {step, source, path, epoch};
        None otherwise. Such a run is finished for that setting (exit 0), not stopped to be continued."""
        end = self.last_outcome()
        dry = end.get("source_dry") if end is not None else None
        return {"step": end["step"], **dry} if isinstance(dry, dict) else None

    def finished(self, steps: int) -> int | None:
        """The step a finished run ended at (>= steps, with no early stop), None when it has more to train."""
        end = self.last_outcome()
        if end is None or end.get("stopped") or not isinstance(end.get("step"), int):
            return None
        return end["step"] if end["step"] >= steps else None

    def saved_config(self) -> dict | None:
        """The resolved config of the last start (renamed keys under their new names: config.RENAMED_KEYS), None
        when there is none (or it cannot be read)."""
        try:
            return translate_renamed(tomllib.loads(self.config.read_text()))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            return None

    def open(self, resolved: dict) -> str:
        """Create the directory, write the resolved config (an earlier start's different one kept as
        config.<n>.toml; the config of a start that never trained is simply replaced) and the run id; return the
        id."""
        self.path.mkdir(parents=True, exist_ok=True)
        text = tomli_w.dumps(resolved)
        if self.started() and self.saved_config() not in (None, tomllib.loads(text)):
            n = 1
            while self.config.with_name(f"config.{n}.toml").exists():
                n += 1
            self.config.rename(self.config.with_name(f"config.{n}.toml"))
        self.config.write_text(text)
        id_file = self.path / RUN_ID
        if not id_file.exists():
            id_file.write_text(uuid.uuid4().hex + "\n")
        return id_file.read_text().strip()


_DEFAULT_NAME = re.compile(r"-(\d{8}-\d{6})(?:-(\d+))?$")


def find_run(name: str, resolved: dict, root: str | Path = RUNS_ROOT) -> RunDir | None:
    """The newest runs/<name>-<date>-<time>[-n] whose run the config `resolved` continues (the same run by
    scaletrain.run.resume's rules: typing the command again, with or without run.stop_at_step or in another layout,
    continues its run), None when there is none."""
    name, root = name or "run", absolute(root)
    accepted = resolved.get("run", {}).get("accept_changes", [])
    made = []
    for d in root.glob(f"{name}-*"):
        m = _DEFAULT_NAME.search(d.name)
        if m and d.name[: m.start()] == name:
            made.append(((m.group(1), int(m.group(2) or 1)), d))
    for _, d in sorted(made, reverse=True):
        saved = RunDir(d).saved_config()
        if saved is not None and not resume_problems(saved, resolved, accepted):
            return RunDir(d)
    return None


def default_run_dir(name: str, resolved: dict, root: str | Path = RUNS_ROOT) -> RunDir:
    """The run directory of a command without --run.dir (`resolved`: its resolved config): the run it continues
    (find_run), else a new one, made here with an exclusive mkdir so that two runs started in the same second get
    two directories."""
    found = find_run(name, resolved, root)
    if found is not None:
        return found
    root = absolute(root)
    root.mkdir(parents=True, exist_ok=True)
    stamp = f"{name or 'run'}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    for n in range(1, 1000):
        path = root / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return RunDir(path)
    raise FileExistsError(f"could not make a new run directory under {root}")


def continue_command(argv: list[str], run_dir: Path) -> str:
    """The command that continues a run: the one typed, without run.stop_at_step (which ended this start), with
    --run.dir when the command named none (as the working directory sees it)."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.replace("_", "-").startswith("--run.stop-at-step"):
            i += 1 if "=" in arg else 2
            continue
        out.append(arg)
        i += 1
    if not any(a.replace("_", "-").startswith("--run.dir") for a in out):
        out += ["--run.dir", shown(run_dir)]
    return shlex.join(["scaletrain", *out])


def open_run_dir(
    resolved: dict, is_main: bool, share: Callable[[Any], Any] = lambda x: x
) -> tuple[RunDir, str]:
    """The run directory and the run id on every rank; rank 0 opens it and writes `resolved` (the config) there.
    `share` hands rank 0's value to every rank (a broadcast over the CPU control group; on one process, itself).
    A job started by an outside torchrun without --run.dir goes where rank 0's default_run_dir says (the CLI fills
    it in for every other start)."""
    path = resolved["run"].get("dir")
    if not path:
        path = share(
            str(default_run_dir(resolved["run"].get("name", ""), resolved).path) if is_main else None
        )
        resolved = {**resolved, "run": {**resolved["run"], "dir": path}}
    run = RunDir.at(path)
    return run, share(run.open(resolved) if is_main else None)
