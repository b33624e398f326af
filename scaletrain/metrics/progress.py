"""Rank 0's console view of a run: a live progress bar while training and a summary table at the end.

Without a terminal (a log file, CI) no bar is drawn; the train loop's log lines are the record.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import rich.progress as rp
from rich.console import Console
from rich.table import Table

from scaletrain.precision import cpu_precision_warning

if TYPE_CHECKING:
    from scaletrain.config import Config
    from scaletrain.parallel import DistEnv
    from scaletrain.precision import Precision

log = logging.getLogger("scaletrain")


def _si(value: float) -> str:
    """12345 -> '12.3k': tokens/s spans 1e2 (CPU) to 1e7 (a GPU cluster)."""
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g}{suffix}"
    return f"{value:.3g}"


class Progress:
    """A bar with step/total, ETA, loss, tokens/s, MFU, learning rate and the newest event; a no-op when disabled
    or not on a terminal."""

    def __init__(
        self, total_steps: int, start_step: int, enabled: bool, console: Console | None = None
    ) -> None:
        self.console = console or Console()
        # rich would otherwise print the bar's final frame into a log file; there the log lines say the same.
        self.live = enabled and self.console.is_terminal
        self._bar: rp.Progress | None = None
        self._task: rp.TaskID | None = None
        self.total_steps = total_steps
        self.start_step = start_step

    def __enter__(self) -> Progress:
        if self.live:
            self._bar = rp.Progress(
                rp.TextColumn("[bold]train"),
                rp.BarColumn(),
                rp.MofNCompleteColumn(),
                rp.TimeElapsedColumn(),
                rp.TextColumn("eta"),
                rp.TimeRemainingColumn(),
                rp.TextColumn("{task.fields[stats]}"),
                console=self.console,
            )
            # A resumed run starts part-way; rich's ETA uses the rate of recent updates, so it stays right.
            self._task = self._bar.add_task(
                "train", total=self.total_steps, completed=self.start_step, stats=""
            )
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def update(
        self,
        step: int,
        loss: float,
        tokens_per_s: float,
        lr: float,
        mfu: float | None = None,
        event: str = "",
    ) -> None:
        """Show `step` optimizer steps completed, with the latest loss, throughput, MFU (a fraction), learning rate
        and the newest event (e.g. "checkpoint_saved (step 100)")."""
        if self._bar is None or self._task is None:
            return
        self._bar.update(self._task, completed=step, stats=stats_text(loss, tokens_per_s, lr, mfu, event))


def stats_text(loss: float, tokens_per_s: float, lr: float, mfu: float | None = None, event: str = "") -> str:
    """The figures beside the bar: "loss 2.3456  12.3k tok/s  mfu 41.0%  lr 3.00e-04  | checkpoint_saved (step
    100)"; MFU and the event only when known."""
    text = f"loss {float(loss):.4f}  {_si(float(tokens_per_s))} tok/s"
    if mfu is not None:
        text += f"  mfu {100 * float(mfu):.1f}%"
    text += f"  lr {float(lr):.2e}"
    return text + (f"  | {event}" if event else "")


def print_summary(rows: dict[str, object], console: Console | None = None) -> None:
    """Print the end-of-run table (steps, tokens, losses, tokens/s, MFU, wall time, run dir); call on rank 0."""
    table = Table(title="Run summary", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for name, value in rows.items():
        table.add_row(name, f"{value:.4g}" if isinstance(value, float) else str(value))
    (console or Console()).print(table)


def log_line(step: int, total: int, m: dict) -> str:
    """The one-line log of a metrics record."""
    val = f" | val {m['val_loss']:.4f}" if "val_loss" in m else ""
    suspect = " (peak suspect)" if m.get("mfu_peak_suspect") else ""
    return (
        f"step {step}/{total} | loss {m['loss']:.4f}{val} | lr {m['lr']:.2e} | gnorm {m['grad_norm']:.3f} | "
        f"{m['tokens_per_s']:.0f} tok/s | mfu {100 * m['mfu']:.2f}%{suspect} | mem {m['mem_peak_mib']:.0f} MiB"
    )


def run_summary(step: int, tokens: int, last: dict, evals: dict[int, float], **extra: object) -> dict:
    """The end-of-run figures at `step`, where the run stopped: `tokens` trained up to it, `last` its metrics record
    (its loss, throughput and MFU), `evals` the run's validation losses by step across all its starts (those past
    `step`, from a branch a rollback discarded, left out)."""
    vals = [evals[s] for s in sorted(evals) if s <= step]
    return {
        "steps": step,
        "tokens": tokens,
        "final_loss": last.get("loss"),
        "first_val_loss": vals[0] if vals else None,
        "final_val_loss": vals[-1] if vals else None,
        "tokens_per_s": last.get("tokens_per_s"),
        "mfu": last.get("mfu"),
        **extra,
    }


def recorded_evals(events: list[dict]) -> dict[int, float]:
    """{step: val_loss} of a run's `eval` events (events.jsonl, every start of the run); a step evaluated again after a
    rollback or a restart keeps its latest value. A non-finite loss, written as null, is left out."""
    out: dict[int, float] = {}
    for e in events:
        step, val = e.get("step"), e.get("val_loss")
        if e.get("kind") == "eval" and isinstance(step, int) and isinstance(val, int | float):
            out[step] = float(val)
    return out


def record_at(records: list[dict], step: int) -> dict:
    """The latest metrics record (metrics.jsonl) of `step`, {} when there is none."""
    return next((r for r in reversed(records) if r.get("step") == step), {})


def announce(
    cfg: Config, env: DistEnv, n: dict, layout: str, batch: int, tokens: int, peak: str, precision: Precision
) -> None:
    """The job's setup in two log lines (after the CPU precision warning, if any)."""
    t, mode = cfg.training, "deterministic" if cfg.training.deterministic else "non-deterministic"
    if warning := cpu_precision_warning(precision.name, env.device.type):
        log.warning(warning)
    # Under MoE a token uses only its top_k experts: the active count is what MFU's FLOPs are made of.
    sparse = n.get("active", n["non_embedding"]) != n["non_embedding"]
    active = f", {n['active']:,} active per token" if sparse else ""
    log.info(
        f"model {cfg.model.preset}: {n['total']:,} parameters ({n['non_embedding']:,} without the embedding"
        f"{active})"
    )
    log.info(
        f"layout {layout}; precision {precision.describe()} on {env.device.type} x{env.world_size} ({mode}); "
        "global batch "
        f"{batch} sequences = {tokens} tokens, micro-batch {t.micro_batch}; MFU peak: {peak}"
    )
