"""MFU that cannot read above 100% unnoticed (issue 24): causal attention counted as half, a CPU peak re-measured
when stale and never cached from a busy machine, and a run that exceeds its peak flagged. No timing: the
measurement, the load and the clock are replaced."""

from __future__ import annotations

import importlib
import json
import time

import pytest
import torch

import scaletrain.hardware as hardware
import scaletrain.metrics.meter as meter_module
from scaletrain.metrics import device_peak_flops, flops_per_token, log_line
from scaletrain.metrics.meter import StepMeter

mfu_module = importlib.import_module("scaletrain.metrics.mfu")
CPU = torch.device("cpu")


@pytest.fixture
def measured(monkeypatch):
    """Every CPU peak measurement, recorded; each returns 3e11 FLOP/s. The machine reads quiet."""
    calls: list[tuple[str, int]] = []

    def fake_measure(precision, threads, **kwargs):
        calls.append((precision, threads))
        return 3.0e11

    monkeypatch.setattr(mfu_module, "measure_cpu_peak", fake_measure)
    monkeypatch.setattr(mfu_module, "busy_reason", lambda: None)
    return calls


def test_causal_attention_flops_are_half_the_full_count():
    # N=1000, L=2, d=16, s=32. Weights: 6N = 6000. Attention per layer and token: QKᵀ and AV, 2·d FLOPs per key
    # each, over s/2 keys on average under the causal mask, times 3 for forward + backward: 3·2·2·d·s/2 = 6·d·s.
    n, layers, d, s = 1000, 2, 16, 32
    by_hand = 6 * n + layers * 3 * 2 * (2 * d) * (s / 2)
    assert by_hand == 6000 + 6144
    assert flops_per_token(n_params=n, n_layers=layers, dim=d, seq_len=s) == by_hand
    # The non-causal count (PaLM's 12·L·d·s) would be 6000 + 12288.
    assert flops_per_token(n, layers, d, s) < 6 * n + 12 * layers * d * s


def test_a_stale_cached_cpu_peak_is_measured_again(tmp_path, measured):
    device_peak_flops(CPU, "fp32", 0.0, tmp_path)
    _, source = device_peak_flops(CPU, "fp32", 0.0, tmp_path)
    assert len(measured) == 1 and "read from" in source
    path = tmp_path / "cpu_peak.json"
    cache = json.loads(path.read_text())
    (entry,) = cache.values()
    entry["measured_at"] = time.time() - mfu_module.CPU_PEAK_MAX_AGE_S - 60
    path.write_text(json.dumps(cache))
    _, source = device_peak_flops(CPU, "fp32", 0.0, tmp_path)
    assert len(measured) == 2 and "cached in" in source
    (entry,) = json.loads(path.read_text()).values()
    assert time.time() - entry["measured_at"] < 60  # the fresh figure replaced the stale one


def test_a_cached_cpu_peak_from_another_cpu_allowance_is_not_reused(tmp_path, measured, monkeypatch):
    monkeypatch.setattr(mfu_module, "usable_cpus", lambda: 4)
    device_peak_flops(CPU, "fp32", 0.0, tmp_path)
    monkeypatch.setattr(mfu_module, "usable_cpus", lambda: 2)  # a cgroup quota or affinity mask changed
    device_peak_flops(CPU, "fp32", 0.0, tmp_path)
    assert len(measured) == 2
    entries = json.loads((tmp_path / "cpu_peak.json").read_text()).values()
    assert sorted(e["usable_cpus"] for e in entries) == [2, 4]


def test_a_cpu_peak_measured_under_load_is_used_but_not_cached(tmp_path, measured, monkeypatch):
    monkeypatch.setattr(mfu_module, "busy_reason", lambda: "load average 3.00 > 0.5 x 2 usable CPUs")
    peak, source = device_peak_flops(CPU, "fp32", 0.0, tmp_path)
    assert peak == 3.0e11
    assert "under load" in source and "not cached" in source and "load average 3.00" in source
    assert not (tmp_path / "cpu_peak.json").exists()
    device_peak_flops(CPU, "fp32", 0.0, tmp_path)
    assert len(measured) == 2  # the next run measures again


@pytest.mark.parametrize(("load", "busy"), [(0.9, False), (1.1, True)])
def test_busy_reason_compares_the_load_average_with_the_usable_cpus(monkeypatch, load, busy):
    monkeypatch.setattr(hardware.os, "getloadavg", lambda: (load, 0.0, 0.0))
    reason = hardware.busy_reason(cpus=2)
    assert (reason is not None) == busy
    if busy:
        assert "1.10" in reason and "2 usable CPUs" in reason


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(meter_module.time, "perf_counter", lambda: now[0])
    return now


def test_a_run_above_its_cached_peak_is_flagged_and_the_peak_dropped(tmp_path, measured, clock):
    from scaletrain.metrics import over_peak_action  # imported here: the module's other tests run without it

    device_peak_flops(CPU, "fp32", 0.0, tmp_path)
    path = tmp_path / "cpu_peak.json"
    assert len(json.loads(path.read_text())) == 1
    events = []
    act = over_peak_action(lambda kind, **f: events.append((kind, f)), CPU, "fp32", 0.0, tmp_path)
    # 1000 tokens/s at 1 FLOP per token against a peak of 500 FLOP/s: 200%.
    m = StepMeter(1000, 1.0, 500.0, CPU, on_over_peak=act)
    records = []
    for _ in range(2):
        clock[0] += 1.0
        m.step_done()
        records.append(m.read())
    assert [r["mfu"] for r in records] == pytest.approx([2.0, 2.0])
    assert all(r["mfu_peak_suspect"] is True for r in records)
    assert events == [("mfu_over_peak", {"mfu": pytest.approx(2.0), "cached_peak_dropped": True})]
    assert json.loads(path.read_text()) == {}  # the next run measures the peak again
    line = log_line(1, 10, {"loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "mem_peak_mib": 1.0, **records[0]})
    assert "mfu 200.00% (peak suspect)" in line


def test_a_run_below_its_peak_carries_no_flag(clock):
    events = []
    m = StepMeter(1000, 1.0, 4000.0, CPU, on_over_peak=events.append)
    clock[0] += 1.0
    m.step_done()
    out = m.read()
    assert out["mfu"] == pytest.approx(0.25) and "mfu_peak_suspect" not in out and events == []
