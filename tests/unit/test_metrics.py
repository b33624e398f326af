"""Unit tests for scaletrain.metrics: FLOP counting, MFU, device peaks, memory, the run-record writer, progress."""

from __future__ import annotations

import importlib
import io
import json

import numpy as np
import pytest
import torch
from rich.console import Console

from scaletrain.hardware import gpu_peak_flops
from scaletrain.metrics import (
    MetricsWriter,
    Progress,
    device_peak_flops,
    flops_per_token,
    measure_cpu_peak,
    mfu,
    peak_memory_mib,
    print_summary,
    recorded_evals,
    run_summary,
)
from tests.helpers import read_jsonl

# The package exports the function `mfu`, which shadows the submodule of the same name as an attribute.
mfu_module = importlib.import_module("scaletrain.metrics.mfu")

CPU = torch.device("cpu")


@pytest.fixture
def quiet(monkeypatch):
    """The machine reads as idle, so a measured CPU peak is cached whatever this test host's load."""
    monkeypatch.setattr(mfu_module, "busy_reason", lambda: None)


def test_flops_per_token_matches_the_causal_palm_formula_by_hand():
    # N=1000, L=2, d=16, s=32: 6*1000 + 6*2*16*32 = 6000 + 6144 (causal attention counted as half)
    assert flops_per_token(n_params=1000, n_layers=2, dim=16, seq_len=32) == 12144.0


def test_mfu_is_achieved_over_peak():
    # 1000 tok/s * 18288 FLOP/tok = 18.288 MFLOP/s achieved; over a 36.576 MFLOP/s peak -> 0.5
    assert mfu(tokens_per_s=1000.0, flops_per_token=18288.0, peak_flops_total=36.576e6) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="peak_flops_total"):
        mfu(1000.0, 18288.0, 0.0)


def test_override_wins_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(
        mfu_module, "measure_cpu_peak", lambda *a, **k: pytest.fail("override must not measure")
    )
    peak, source = device_peak_flops(CPU, "bf16", override_tflops=2.5, cache_dir=tmp_path)
    assert peak == 2.5e12
    assert source == "configured: metrics.peak_tflops=2.5"
    assert not (tmp_path / "cpu_peak.json").exists()


def test_cpu_peak_is_measured_once_then_read_from_cache(tmp_path, monkeypatch, quiet):
    calls = []

    def fake_measure(precision, threads, **kwargs):
        calls.append((precision, threads))
        return 3.0e11

    monkeypatch.setattr(mfu_module, "measure_cpu_peak", fake_measure)
    first, first_source = device_peak_flops(CPU, "fp32", override_tflops=0.0, cache_dir=tmp_path)
    second, second_source = device_peak_flops(CPU, "fp32", override_tflops=0.0, cache_dir=tmp_path)
    assert calls == [("fp32", torch.get_num_threads())]
    assert first == second == 3.0e11
    assert "measured" in first_source and "measured" in second_source
    assert "read from" in second_source
    cache = json.loads((tmp_path / "cpu_peak.json").read_text())
    (entry,) = cache.values()
    assert entry["flops"] == 3.0e11 and entry["precision"] == "fp32" and entry["torch"] == torch.__version__

    # Another precision is a different key: measured again, the first entry kept.
    device_peak_flops(CPU, "bf16", override_tflops=0.0, cache_dir=tmp_path)
    assert len(calls) == 2
    assert len(json.loads((tmp_path / "cpu_peak.json").read_text())) == 2


def test_corrupt_cpu_cache_is_remeasured(tmp_path, monkeypatch, quiet):
    (tmp_path / "cpu_peak.json").write_text("{not json")
    monkeypatch.setattr(mfu_module, "measure_cpu_peak", lambda precision, threads, **k: 1.0e11)
    peak, _ = device_peak_flops(CPU, "fp32", override_tflops=0.0, cache_dir=tmp_path)
    assert peak == 1.0e11
    assert len(json.loads((tmp_path / "cpu_peak.json").read_text())) == 1


def test_measure_cpu_peak_returns_plausible_flops():
    threads = torch.get_num_threads()
    flops = measure_cpu_peak("fp32", threads=1, size=128, budget_s=0.02)
    assert 1e7 < flops < 1e14
    assert torch.get_num_threads() == threads  # restored


@pytest.mark.parametrize(
    ("name", "precision", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H200", "fp32", 66.9),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A10G", "bf16", 125.0),
        ("NVIDIA L40S", "bf16", 362.0),  # must not be taken for an L4 or L40
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA GeForce RTX 4090", "fp32", 82.6),
    ],
)
def test_gpu_table_lookup(name, precision, tflops):
    assert gpu_peak_flops(name, precision) == pytest.approx(tflops * 1e12)


def test_gpu_table_misses_return_none():
    assert gpu_peak_flops("Some Future Accelerator", "bf16") is None
    assert gpu_peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores: measure instead


def test_cuda_device_uses_table_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    peak, source = device_peak_flops(torch.device("cuda", 0), "bf16", override_tflops=0.0, cache_dir=tmp_path)
    assert peak == pytest.approx(989.4e12)
    assert source == "table: NVIDIA H100 80GB HBM3 bf16 989.4 TFLOP/s"


def test_unknown_precision_is_refused(tmp_path):
    with pytest.raises(ValueError, match="precision"):
        device_peak_flops(CPU, "fp8", override_tflops=1.0, cache_dir=tmp_path)


def test_writer_appends_metrics_and_events_as_json_lines(tmp_path):
    writer = MetricsWriter(tmp_path, enabled=True, tensorboard=False)
    writer.log(1, {"loss": torch.tensor(2.5), "lr": np.float32(0.5), "tokens": 4096})
    writer.log(2, {"loss": 2.25, "lr": 0.25, "tokens": 8192, "grad_norm": float("nan")})
    writer.event("checkpoint_saved", step=2, path=tmp_path / "checkpoints")
    writer.event("restart")
    # Flushed per line: readable before close.
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    writer.close()

    # Records carry the wall clock like events (goodput places them among the events by it).
    events = read_jsonl(tmp_path / "events.jsonl")
    assert all(isinstance(r["time"], float) and 1.6e9 < r["time"] <= events[0]["time"] for r in metrics)
    assert [{k: v for k, v in r.items() if k != "time"} for r in metrics] == [
        {"step": 1, "loss": 2.5, "lr": 0.5, "tokens": 4096},
        {"step": 2, "loss": 2.25, "lr": 0.25, "tokens": 8192, "grad_norm": None},
    ]
    assert [(e["kind"], e["step"]) for e in events] == [("checkpoint_saved", 2), ("restart", None)]
    assert events[0]["path"] == str(tmp_path / "checkpoints")
    assert all(isinstance(e["time"], float) and e["time"] > 1.6e9 for e in events)
    assert not (tmp_path / "tensorboard").exists()


def test_writer_writes_tensorboard_scalars_when_asked(tmp_path):
    with MetricsWriter(tmp_path, enabled=True, tensorboard=True) as writer:
        writer.log(1, {"loss": 2.5})
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert [(r["step"], r["loss"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [(1, 2.5)]


def test_writer_appends_to_an_existing_run(tmp_path):
    with MetricsWriter(tmp_path, enabled=True, tensorboard=False) as writer:
        writer.log(1, {"loss": 3.0})
    with MetricsWriter(tmp_path, enabled=True, tensorboard=False) as writer:
        writer.log(2, {"loss": 2.0})
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


def test_disabled_writer_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    with MetricsWriter(run_dir, enabled=False, tensorboard=True) as writer:
        writer.log(1, {"loss": 1.0})
        writer.event("restart", step=1)
    assert not run_dir.exists()


def test_writer_refuses_reserved_keys(tmp_path):
    with MetricsWriter(tmp_path, enabled=True, tensorboard=False) as writer:
        with pytest.raises(ValueError, match="step"):
            writer.log(1, {"step": 3.0})
        with pytest.raises(ValueError, match="time"):
            writer.log(1, {"time": 3.0})
        with pytest.raises(ValueError, match="time"):
            writer.event("fault", step=1, time=0.0)


def test_peak_memory_is_positive_on_cpu():
    mib = peak_memory_mib(CPU)
    # This process has at least imported torch (tens of MiB) and is surely under 1 TiB.
    assert 10 < mib < 2**20


def test_progress_draws_nothing_without_a_terminal():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False)
    with Progress(total_steps=10, start_step=2, enabled=True, console=console) as progress:
        assert not progress.live
        progress.update(3, loss=2.0, tokens_per_s=1000.0, lr=1e-3)
    assert out.getvalue() == ""


def test_progress_shows_step_loss_and_throughput_on_a_terminal():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160)
    with Progress(total_steps=10, start_step=2, enabled=True, console=console) as progress:
        progress.update(3, loss=2.0, tokens_per_s=12345.0, lr=1e-3)
    text = out.getvalue()
    assert "3/10" in text and "loss 2.0000" in text and "12.3k tok/s" in text


def test_print_summary_lists_every_row():
    out = io.StringIO()
    print_summary({"steps": "200", "MFU": "41.0%"}, console=Console(file=out, width=80))
    text = out.getvalue()
    assert "Run summary" in text and "steps" in text and "200" in text and "41.0%" in text


def test_run_summary_takes_the_runs_evaluations_up_to_the_stop_step():
    """The first validation loss is the run's (an earlier start's), a step evaluated again keeps its latest value,
    and an evaluation past the stop step (from a branch a rollback discarded) is not the final one."""
    events = [
        {"kind": "eval", "step": 0, "val_loss": 6.0},
        {"kind": "eval", "step": 10, "val_loss": 3.0},
        {"kind": "rollback", "step": 12, "to_step": 5},
        {"kind": "eval", "step": 10, "val_loss": 2.9},
        {"kind": "eval", "step": 20, "val_loss": None},  # a non-finite loss, written as null
        {"kind": "start", "step": 0, "val_loss": 1.0},
    ]
    evals = recorded_evals(events)
    assert evals == {0: 6.0, 10: 2.9}
    summary = run_summary(12, 12 * 512, {"loss": 2.5}, {**evals, 15: 2.0})
    assert summary["tokens"] == 6144 and summary["final_loss"] == 2.5
    assert (summary["first_val_loss"], summary["final_val_loss"]) == (6.0, 2.9)
