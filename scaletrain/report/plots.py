"""The report's PNG plots, drawn with matplotlib's object API on the Agg canvas (no display, no pyplot state).

Several runs share each plot's axes, one colour per run. A plot without data for any run is still drawn and
says "no data", so the page always has the same plots and a missing metric never fails the report.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from scaletrain.report.runs import Run, event_marks, series, val_series

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
# Events that change what the curves mean, marked as vertical lines on the loss plot (the events plot shows all).
INCIDENTS = {
    "restart": "#d62728",
    "failure": "#7f0000",
    "rollback": "#ff7f0e",
    "skipped_step": "#bcbd22",
    "loss_spike": "#e377c2",
    "fault_injected": "#8c564b",
    "straggler": "#9467bd",
    "preempted": "#17becf",
    "hang": "#000000",
    "checkpoint_saved": "#2ca02c",
}
DPI = 100
SIZE = (6.4, 3.2)  # inches: 640 x 320 px, two plots side by side fit a laptop screen


@dataclass
class Plot:
    name: str
    """File stem (loss -> loss.png) and the <img> id on the page."""
    title: str
    png: bytes
    has_data: bool


def _colour(i: int) -> str:
    return COLOURS[i % len(COLOURS)]


def _metric(
    key: str, ylabel: str, scale: float = 1.0, log: bool = False
) -> Callable[[Axes, list[Run]], bool]:
    """A plot of one metrics key against the step, one line per run."""

    def draw(ax: Axes, runs: list[Run]) -> bool:
        drawn = False
        for i, run in enumerate(runs):
            steps, values = series(run, key)
            if steps:
                label = run.name if len(runs) > 1 else None  # one run: the title says what the line is
                ax.plot(steps, [v * scale for v in values], color=_colour(i), label=label, lw=1.4)
                drawn = True
        if drawn and log and all(v > 0 for run in runs for v in series(run, key)[1]):
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        return drawn

    return draw


def _loss(ax: Axes, runs: list[Run]) -> bool:
    """Training loss (solid) and validation loss (dashed, dots), with the incidents as vertical lines."""
    drawn = False
    for i, run in enumerate(runs):
        steps, losses = series(run, "loss")
        if steps:
            ax.plot(steps, losses, color=_colour(i), lw=1.4, label=f"{run.name} train")
        vsteps, vals = val_series(run)
        if vsteps:
            ax.plot(
                vsteps, vals, color=_colour(i), lw=1.2, ls="--", marker="o", ms=3, label=f"{run.name} val"
            )
        drawn = drawn or bool(steps or vsteps)
    seen: set[str] = set()
    for run in runs:
        for kind, steps in event_marks(run.events).items():
            if kind in INCIDENTS:
                for s in steps:
                    label = None if kind in seen else kind
                    ax.axvline(s, color=INCIDENTS[kind], lw=0.8, ls=":", alpha=0.8, label=label)
                    seen.add(kind)
    ax.set_ylabel("loss")
    return drawn


def _events(ax: Axes, runs: list[Run]) -> bool:
    """One row per event kind, a marker at each step it happened (runs side by side, offset a little)."""
    kinds: list[str] = []
    for run in runs:
        kinds += [k for k in event_marks(run.events) if k not in kinds]
    for i, run in enumerate(runs):
        offset = (i - (len(runs) - 1) / 2) * 0.15
        for n, (kind, steps) in enumerate(event_marks(run.events).items()):
            y = [kinds.index(kind) + offset] * len(steps)
            ax.scatter(steps, y, color=_colour(i), marker="|", s=120, lw=1.6, label=None if n else run.name)
    ax.set_yticks(range(len(kinds)), kinds, fontsize=8)
    ax.set_ylim(-0.7, max(len(kinds), 1) - 0.3)
    return bool(kinds)


def _data_mix(ax: Axes, runs: list[Run]) -> bool:
    """data.streaming: each source's realised share of the samples per logged step (data_share/NAME), a line per
    run and source; the schedule's stages and blends show as its steps and slopes."""
    drawn = False
    for i, run in enumerate(runs):
        keys = sorted({k for m in run.metrics for k in m if k.startswith("data_share/")})
        for j, key in enumerate(keys):
            steps, shares = series(run, key)
            name = key.removeprefix("data_share/")
            label = f"{run.name} {name}" if len(runs) > 1 else name
            ax.plot(
                steps,
                shares,
                color=_colour(i * len(keys) + j),
                lw=1.4,
                ls=["-", "--", ":"][i % 3],
                label=label,
            )
            drawn = drawn or bool(steps)
    ax.set_ylabel("share of samples")
    return drawn


GOODPUT_PARTS = [
    ("productive_s", "training", "#2ca02c"),
    ("eval_s", "evaluation", "#1f77b4"),
    ("checkpoint_stall_s", "checkpoint stall", "#ff7f0e"),
    ("restart_s", "restarts", "#d62728"),
    ("recomputed_s", "recomputed steps", "#e377c2"),
    ("other_s", "other (start-up, logging)", "#c7c7c7"),
]


def _goodput(ax: Axes, runs: list[Run]) -> bool:
    """Where each run's wall-clock time went (resilience.goodput): one stacked bar per run, goodput written on it."""
    rows = [(i, run) for i, run in enumerate(runs) if run.goodput and run.goodput.get("total_s", 0) > 0]
    for n, (_, run) in enumerate(rows):
        left = 0.0
        for key, label, colour in GOODPUT_PARTS:
            width = max(0.0, float(run.goodput.get(key) or 0.0))
            ax.barh(n, width, left=left, color=colour, label=label if width > 0 else None, height=0.5)
            left += width
        ax.text(left, n, f"  goodput {100 * run.goodput['goodput']:.1f}%", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [run.name for _, run in rows], fontsize=8)
    ax.invert_yaxis()  # the first run on top, as in the tables
    ax.set_xlabel("seconds")
    ax.margins(x=0.25)
    handles, labels = ax.get_legend_handles_labels()
    by_label = dict(zip(labels, handles))  # one entry per part, however many runs have it
    if by_label:
        ax.legend(
            by_label.values(),
            by_label.keys(),
            fontsize=7,
            ncol=3,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.22),
        )
    return bool(rows)


# name, title, how it is drawn, and whether its x axis is the step.
PLOTS: list[tuple[str, str, Callable[[Axes, list[Run]], bool], bool]] = [
    ("loss", "Loss (training and validation)", _loss, True),
    ("lr", "Learning rate", _metric("lr", "learning rate"), True),
    ("grad_norm", "Gradient norm (before clipping)", _metric("grad_norm", "grad norm", log=True), True),
    ("tokens_per_s", "Throughput", _metric("tokens_per_s", "tokens/s"), True),
    ("mfu", "Model FLOPs utilisation", _metric("mfu", "MFU (%)", scale=100.0), True),
    ("memory", "Peak memory", _metric("mem_peak_mib", "MiB"), True),
    ("data_mix", "Data mixture: the share of the samples per source", _data_mix, True),
    ("goodput", "Goodput: where the wall-clock time went", _goodput, False),
    ("events", "Events", _events, True),
]


def render(
    name: str, title: str, draw: Callable[[Axes, list[Run]], bool], runs: list[Run], steps: bool
) -> Plot:
    fig = Figure(figsize=SIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    has_data = draw(ax, runs)
    if has_data:
        ax.grid(alpha=0.3)
        if steps:
            ax.set_xlabel("step")
        if ax.get_legend() is None and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    else:
        ax.set_xticks([])
        ax.set_yticks([])
        ax.text(
            0.5, 0.5, "no data", ha="center", va="center", fontsize=14, color="#777", transform=ax.transAxes
        )
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return Plot(name, title, buf.getvalue(), has_data)


def render_all(runs: list[Run]) -> list[Plot]:
    """Every plot of the report, in page order."""
    return [render(name, title, draw, runs, steps) for name, title, draw, steps in PLOTS]
