"""`scaletrain bench`: a matrix of config switches, each trained beside the plain configuration on this device in
alternating rounds (plain, v1, v2, plain, v1, v2, ...), so that a shared machine's drift hits every variant alike;
it prints tokens/s, MFU, peak memory, data-parallel bytes and the final loss, with each variant's ratio to the plain
run of the same round and the spread of those ratios over rounds (min / median / max).

    scaletrain bench --config configs/debug.toml --variants "precision.compute=bf16" "training.compile=true" \\
        --nproc 2 --steps 30 --rounds 3
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from scaletrain.errors import ConfigError, UserError
from scaletrain.metrics import cpu_features
from scaletrain.run.child import run_train
from scaletrain.validate import check_configs

PLAIN = "plain"
# Every run: metrics every step, no evaluation, no checkpoints, no progress bar (the user's overrides come first,
# so these win): only the switches differ between the runs.
FORCED = [
    "--metrics.log_interval", "1", "--metrics.progress", "false", "--metrics.tensorboard", "false",
    "--training.eval_interval", "0", "--checkpoint.enabled", "false",
]  # fmt: skip
FIGURES = ("tokens_per_s", "mfu", "mem_peak_mib", "comm_bytes", "loss")


def parse_variant(text: str) -> list[str]:
    """'precision.compute=bf16,training.compile=true' -> ['--precision.compute', 'bf16', ...]."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or "." not in key.strip():
            raise ConfigError(
                f"variant '{text}': '{item}' is not section.key=value (e.g. precision.compute=bf16)"
            )
        out += [f"--{key.strip()}", value.strip()]
    if not out:
        raise ConfigError(f"variant '{text}' sets nothing; give section.key=value pairs separated by commas")
    return out


def schedule(n_variants: int, rounds: int) -> list[tuple[int, int]]:
    """(round, variant index) in the order they run; index 0 is the plain configuration."""
    return [(r, v) for r in range(rounds) for v in range(n_variants + 1)]


def run_figures(rows: list[dict]) -> dict[str, float]:
    """One run's figures from its per-step records: throughput figures are the median over the steps after the
    first fifth (at least the first step: warm-up, allocation, compilation), peak memory the largest, the loss
    the mean over the last tenth of the steps."""
    steady = rows[max(1, len(rows) // 5) :] or rows
    tail = rows[-max(1, len(rows) // 10) :]
    out = {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "mfu": statistics.median(r["mfu"] for r in steady),
        "mem_peak_mib": max(r["mem_peak_mib"] for r in rows),
        "loss": statistics.fmean(r["loss"] for r in tail),
    }
    if all("comm_bytes" in r for r in steady):
        out["comm_bytes"] = statistics.median(r["comm_bytes"] for r in steady)
    return out


def spread(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


@dataclass
class VariantResult:
    name: str
    runs: list[dict[str, float]] = field(default_factory=list)  # one per round
    ratios: dict[str, list[float]] = field(default_factory=dict)  # figure -> per-round ratio to plain
    error: str = ""

    def median(self, key: str) -> float | None:
        values = [r[key] for r in self.runs if key in r]
        return statistics.median(values) if values else None


def aggregate(names: list[str], runs: dict[tuple[int, int], dict | str]) -> list[VariantResult]:
    """Per variant: its runs by round and, per figure, the ratio to the plain run of the same round. `runs`
    maps (round, index) to a run's figures or to the error that stopped it."""
    results = [VariantResult(n) for n in names]
    for (r, v), got in sorted(runs.items()):
        if isinstance(got, str):
            results[v].error = results[v].error or got
            continue
        results[v].runs.append(got)
        plain = runs.get((r, 0))
        if isinstance(plain, dict):
            for key in FIGURES:
                if key in got and plain.get(key):
                    results[v].ratios.setdefault(key, []).append(got[key] / plain[key])
    return results


def _cell(res: VariantResult, key: str, fmt: str, scale: float = 1.0) -> str:
    value = res.median(key)
    if value is None:
        return "-"
    text = format(value * scale, fmt)
    if res.name == PLAIN or key not in res.ratios:
        return text
    lo, mid, hi = spread(res.ratios[key])
    return f"{text} (x{mid:.3f} [{lo:.3f}-{hi:.3f}])" if len(res.ratios[key]) > 1 else f"{text} (x{mid:.3f})"


def format_table(results: list[VariantResult]) -> str:
    """One row per variant: medians over rounds, and the median [min-max] over rounds of the ratio to plain."""
    head = ["variant", "tokens/s", "MFU", "peak MiB", "comm MB/step", "final loss"]
    rows = [head]
    for res in results:
        if res.error and not res.runs:
            rows.append([res.name, f"FAILED: {res.error.splitlines()[0]}"])
            continue
        loss = res.median("loss")
        gap = "" if res.name == PLAIN or loss is None or results[0].median("loss") is None else (
            f" ({loss - results[0].median('loss'):+.4f})"
        )  # fmt: skip
        rows.append([
            res.name,
            _cell(res, "tokens_per_s", ",.0f"),
            _cell(res, "mfu", ".1%"),
            _cell(res, "mem_peak_mib", ",.0f"),
            _cell(res, "comm_bytes", ".3f", 1e-6),
            ("-" if loss is None else f"{loss:.4f}") + gap,
        ])  # fmt: skip
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def run_bench(
    config: str | None,
    variants: list[str],
    overrides: list[str],
    *,
    nproc: int = 1,
    steps: int = 20,
    rounds: int = 3,
    out: Callable[[str], None] = print,
    runner: Callable[[list[str], int, Path], list[dict]] = run_train,
) -> list[VariantResult]:
    """Run the matrix and print the table; every variant is parsed and its whole config validated before anything
    runs."""
    if steps < 2 or rounds < 1 or nproc < 1:
        raise ConfigError(
            f"bench needs --steps >= 2, --rounds >= 1, --nproc >= 1 (got {steps}, {rounds}, {nproc})"
        )
    parsed = [[]] + [parse_variant(v) for v in variants]
    names = [PLAIN, *variants]
    settings = overrides + FORCED + ["--training.steps", str(steps)]
    check_configs(config, [(name, settings + args, nproc) for name, args in zip(names, parsed, strict=True)])
    base = (["--config", config] if config else []) + settings
    out(f"CPU: {cpu_features()}")
    runs: dict[tuple[int, int], dict | str] = {}
    with tempfile.TemporaryDirectory(prefix="scaletrain-bench-") as tmp:
        for r, v in schedule(len(variants), rounds):
            try:
                rows = runner(base + parsed[v], nproc, Path(tmp) / f"round{r}-v{v}")
                runs[(r, v)] = run_figures(rows)
            except UserError as e:
                runs[(r, v)] = e.problems[0] if isinstance(e, ConfigError) else str(e)
            got = runs[(r, v)]
            line = f"{got['tokens_per_s']:,.0f} tokens/s" if isinstance(got, dict) else f"FAILED: {got}"
            out(f"round {r + 1}/{rounds} {names[v]}: {line}")
    results = aggregate(names, runs)
    out(
        f"\n{steps} steps x {nproc} process(es), {rounds} alternating round(s); medians over rounds, "
        "(x ratio to plain: median [min-max] over rounds)"
    )
    out(format_table(results))
    return results


def results_json(results: list[VariantResult]) -> str:
    return json.dumps([r.__dict__ for r in results], indent=1)
