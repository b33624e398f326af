"""`scaletrain bench`: the variant syntax, the alternating schedule, per-run figures and the per-round ratios to
plain (no timing: constructed records), and one tiny real run whose table has a row per variant."""

from __future__ import annotations

import pytest

from scaletrain.compare.bench import (
    PLAIN,
    aggregate,
    format_table,
    parse_variant,
    run_bench,
    run_figures,
    schedule,
)
from scaletrain.errors import ConfigError
from tests.helpers import DEBUG, QUICK


def test_parse_variant():
    assert parse_variant("precision.compute=bf16, training.compile = true") == [
        "--precision.compute", "bf16", "--training.compile", "true",
    ]  # fmt: skip
    for bad in ("precision=bf16", "precision.compute", " , "):
        with pytest.raises(ConfigError, match="section.key"):
            parse_variant(bad)


def test_schedule_alternates_plain_and_every_variant_each_round():
    assert schedule(2, 2) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


def _rows(tps: list[float], loss: float = 2.0, comm: float | None = None) -> list[dict]:
    extra = {} if comm is None else {"comm_bytes": comm}
    return [
        {"tokens_per_s": t, "mfu": t / 1e5, "mem_peak_mib": 100.0 + i, "loss": loss, **extra}
        for i, t in enumerate(tps)
    ]


def test_run_figures_drop_the_warmup_and_take_peaks_and_the_final_loss():
    rows = _rows([1.0, 100.0, 110.0, 120.0, 130.0], comm=8.0)
    rows[-1]["loss"] = 1.0
    got = run_figures(rows)
    assert got["tokens_per_s"] == 115.0  # median of the 4 steps after the first fifth
    assert got["mem_peak_mib"] == 104.0 and got["comm_bytes"] == 8.0
    assert got["loss"] == 1.0  # the mean of the last tenth (at least one step)
    assert "comm_bytes" not in run_figures(_rows([1.0, 2.0]))


def test_aggregate_ratios_are_per_round_against_that_rounds_plain():
    runs = {
        (0, 0): {"tokens_per_s": 100.0, "loss": 2.0},
        (0, 1): {"tokens_per_s": 150.0, "loss": 2.1},
        (1, 0): {"tokens_per_s": 50.0, "loss": 2.0},  # a slow round: the variant is slow in it too
        (1, 1): {"tokens_per_s": 100.0, "loss": 2.1},
        (0, 2): "parallel.tp 3 does not divide the world",
        (1, 2): "parallel.tp 3 does not divide the world",
    }
    plain, fast, broken = aggregate([PLAIN, "fast", "broken"], runs)
    assert fast.ratios["tokens_per_s"] == [1.5, 2.0]
    assert plain.ratios["tokens_per_s"] == [1.0, 1.0]
    assert fast.median("tokens_per_s") == 125.0
    assert broken.error and not broken.runs
    table = format_table([plain, fast, broken]).splitlines()
    assert table[0].split()[:2] == ["variant", "tokens/s"]
    assert "125 (x1.750 [1.500-2.000])" in table[2] and "2.1000 (+0.1000)" in table[2]
    assert table[3].startswith("broken") and "FAILED: parallel.tp 3" in table[3]


def test_bench_refuses_bad_variants_before_running():
    ran = []
    with pytest.raises(ConfigError, match="section.key=value"):
        run_bench(None, ["steps=3"], [], runner=lambda *a: ran.append(a) or [])
    assert ran == []


def test_tiny_real_bench(capsys):
    lines = []
    results = run_bench(DEBUG, ["optimizer.lr=1e-3"], QUICK, steps=3, rounds=1, out=lines.append)
    assert [r.name for r in results] == [PLAIN, "optimizer.lr=1e-3"]
    assert all(not r.error and len(r.runs) == 1 for r in results)
    assert lines[0].startswith("CPU: ")
    table = lines[-1].splitlines()
    assert len(table) == 3 and table[1].startswith(PLAIN) and "(x" in table[2]
    assert results[1].median("loss") != results[0].median("loss")  # the switch reached the run
