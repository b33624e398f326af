"""StepMeter: the throughput window, with what it must leave out (stalls, evaluation, the compile step)."""

from __future__ import annotations

import pytest
import torch

import scaletrain.metrics.meter as meter_module
from scaletrain.metrics.meter import StepMeter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(meter_module.time, "perf_counter", c)
    return c


def test_excluded_time_is_not_throughput(clock):
    m = StepMeter(1000, 1.0, 1e12, torch.device("cpu"))
    for _ in range(4):
        clock.now += 1.0
        m.step_done()
    m.exclude(2.0)  # e.g. a checkpoint stall inside the window
    clock.now += 2.0
    out = m.read()
    assert out["tokens_per_s"] == pytest.approx(1000.0) and out["step_time_s"] == pytest.approx(1.0)
    assert "compile_s" not in out


def test_the_compile_step_is_reported_apart_and_left_out_of_tokens_per_s(clock):
    m = StepMeter(1000, 1.0, 1e12, torch.device("cpu"), warmup_steps=1)
    clock.now += 30.0  # step 1 compiles
    m.step_done()
    for _ in range(3):
        clock.now += 0.5
        m.step_done()
    out = m.read()
    assert out["compile_s"] == pytest.approx(30.0)
    assert out["tokens_per_s"] == pytest.approx(2000.0) and out["step_time_s"] == pytest.approx(0.5)
    clock.now += 0.5
    m.step_done()
    assert "compile_s" not in m.read()  # reported once


def test_a_window_of_the_compile_step_alone_reports_that_step(clock):
    m = StepMeter(1000, 1.0, 1e12, torch.device("cpu"), warmup_steps=1)
    clock.now += 10.0
    m.step_done()
    out = m.read()
    assert out["compile_s"] == pytest.approx(10.0) and out["tokens_per_s"] == pytest.approx(100.0)


def test_an_mfu_above_100_percent_is_flagged_once(clock, caplog):
    # 1000 tokens/s at 1 FLOP per token against a peak of 500 FLOP/s: 200%.
    m = StepMeter(1000, 1.0, 500.0, torch.device("cpu"))
    for _ in range(2):
        clock.now += 1.0
        m.step_done()
        assert m.read()["mfu"] == pytest.approx(2.0)
    warned = [r.message for r in caplog.records if "above 100%" in r.message]
    assert len(warned) == 1 and "cpu_peak.json" in warned[0] and "metrics.peak_tflops" in warned[0]
