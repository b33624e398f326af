"""A run directory read back for the report: its resolved config, metrics by step, events, end summary, goodput and
the samples its checkpoints wrote.

Every part may be missing (a run that crashed before its first log, one without evaluation, one still running):
what is missing is None or empty, and the report says "no data" where it would have drawn it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from scaletrain.errors import UserError
from scaletrain.resilience.goodput import compute_goodput
from scaletrain.run.directory import CONFIG, EVENTS, METRICS, SAMPLES, RunDir
from scaletrain.run.resume import flatten

RUN_FILES = (CONFIG, METRICS, EVENTS)


@dataclass
class Run:
    path: Path
    name: str
    config: dict
    """The resolved config of the run's latest start ({} when config.toml is missing or unreadable)."""
    metrics: list[dict]
    """One record per step, sorted: a step run again after a resume or rollback keeps its last record."""
    events: list[dict]
    summary: dict | None
    """The fields of the last `end` event: None while the run is going, or when it ended without one."""
    goodput: dict | None
    """compute_goodput's breakdown, None when the records cannot say (no `start` event)."""
    unreadable: dict[str, list[int]]
    """Per file, the numbers of the lines that are no JSON record (cut short by a kill or a full disk), left out."""
    samples: list[dict]
    """samples.jsonl: the continuations of metrics.sample_prompt each finished start wrote, oldest first."""


def read_run(path: Path, name: str | None = None) -> Run:
    """Read the run at `path`; a UserError when it is not a run directory."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path} is not a directory; pass a run directory (the --run.dir of a training run)")
    if not any((path / f).is_file() for f in RUN_FILES):
        raise UserError(
            f"{path} is not a run directory: it has none of {', '.join(RUN_FILES)}; pass the directory a "
            "training run wrote (its --run.dir, by default runs/<name>-<date>-<time>)"
        )
    by_step: dict[int, dict] = {}
    run, unreadable = RunDir(path), {METRICS: [], EVENTS: [], SAMPLES: []}
    for record in run.read_metrics(unreadable[METRICS]):
        if isinstance(record.get("step"), int):
            by_step[record["step"]] = record
    events = run.read_events(unreadable[EVENTS])
    ends = [e for e in events if e.get("kind") == "end"]
    summary = {k: v for k, v in ends[-1].items() if k not in ("time", "kind", "step")} if ends else None
    try:
        goodput = compute_goodput(path)
    except (ValueError, OSError):
        goodput = None
    metrics = [by_step[s] for s in sorted(by_step)]
    samples = run.read_samples(unreadable[SAMPLES])
    unreadable = {f: lines for f, lines in unreadable.items() if lines}
    config = run.saved_config() or {}
    return Run(path, name or path.name, config, metrics, events, summary, goodput, unreadable, samples)


def run_names(paths: list[Path]) -> list[str]:
    """A short label per run: its directory name, with the parent's prepended where two names would clash."""
    names = [p.name or str(p) for p in paths]
    out = []
    for i, p in enumerate(paths):
        clash = names.count(names[i]) > 1
        label = f"{p.parent.name}/{p.name}" if clash and p.parent.name else names[i]
        out.append(label if label not in out else f"{label} ({i + 1})")
    return out


def number(value: object) -> float | None:
    """A finite number as float, else None (null for NaN in the records, bools, strings)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def series(run: Run, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of a metrics key, leaving out the steps where it is missing or not a finite number."""
    points = [(m["step"], number(m.get(key))) for m in run.metrics]
    kept = [(s, v) for s, v in points if v is not None]
    return [s for s, _ in kept], [v for _, v in kept]


def val_series(run: Run) -> tuple[list[int], list[float]]:
    """(steps, validation losses): from the `eval` events (they include the evaluation before step 1), else from
    the metrics records' val_loss."""
    evals = [e for e in run.events if e.get("kind") == "eval" and isinstance(e.get("step"), int)]
    by_step = {e["step"]: number(e.get("val_loss")) for e in evals}
    if not by_step:
        by_step = {m["step"]: number(m.get("val_loss")) for m in run.metrics}
    kept = sorted((s, v) for s, v in by_step.items() if v is not None)
    return [s for s, _ in kept], [v for _, v in kept]


def event_marks(events: list[dict]) -> dict[str, list[int]]:
    """{kind: the steps it happened at} for events that have a step, kinds in the order they first appear."""
    marks: dict[str, list[int]] = {}
    for e in events:
        step, kind = e.get("step"), e.get("kind")
        if isinstance(step, int) and not isinstance(step, bool) and isinstance(kind, str):
            marks.setdefault(kind, []).append(step)
    return marks


MISSING = "—"
"""How the report shows a key one run's config lacks."""


def config_diff(configs: list[dict]) -> dict[str, list[object]]:
    """{dotted key: [its value in each config]} for the keys whose values are not all the same, sorted; a key a
    config lacks shows as MISSING. run.dir always differs and names the runs already, so it is left out."""
    flat = [flatten(c) for c in configs]
    keys = sorted(set().union(*flat) - {"run.dir"}) if flat else []
    out = {}
    for key in keys:
        values = [f.get(key, MISSING) for f in flat]
        if any(v != values[0] for v in values[1:]):
            out[key] = values
    return out
