"""`scaletrain report RUN_DIR ...`: PNG plots of one or more runs and one self-contained HTML page with them, the
resolved configs (and their differences), the end-of-run summaries and the events."""

from __future__ import annotations

import logging
from pathlib import Path

from scaletrain.errors import UserError
from scaletrain.report.html import render_page
from scaletrain.report.plots import render_all
from scaletrain.report.runs import Run, config_diff, event_marks, read_run, run_names

__all__ = ["Run", "config_diff", "event_marks", "read_run", "write_report"]

log = logging.getLogger("scaletrain")


def write_report(run_dirs: list[Path], out: Path | None = None) -> Path:
    """Write <out>/index.html and one PNG per plot for the runs (overlaid); return the page's path. `out`
    defaults to <first run>/report. A directory that is not a run is a UserError, before anything is written."""
    if not run_dirs:
        raise UserError("give at least one run directory: scaletrain report RUN_DIR [RUN_DIR ...]")
    paths = [Path(p) for p in run_dirs]
    runs = [read_run(p, name) for p, name in zip(paths, run_names(paths))]
    for run in runs:
        for file, lines in run.unreadable.items():
            log.warning(
                "%s: line(s) %s are no JSON record (cut short by a kill or a full disk?); the report leaves them out",
                run.path / file,
                ", ".join(map(str, lines[:10])) + (" ..." if len(lines) > 10 else ""),
            )
    out = Path(out) if out is not None else paths[0] / "report"
    page = out / "index.html"
    try:
        out.mkdir(parents=True, exist_ok=True)  # before the drawing, which takes seconds
        plots = render_all(runs)
        for plot in plots:
            (out / f"{plot.name}.png").write_bytes(plot.png)
        page.write_text(render_page(runs, plots), encoding="utf-8")
    except OSError as e:
        raise UserError(
            f"could not write the report to {out} ({e}); pass --out DIR with a writable directory"
        ) from None
    return page
