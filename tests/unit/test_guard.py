"""The guard's per-step check: its decisions, and one device-to-host transfer per step for all of it (on a GPU
every float() of a device tensor is a sync that stalls the queue of kernels)."""

from __future__ import annotations

import math

import pytest
import torch

from scaletrain.config import ResilienceConfig
from scaletrain.parallel.mesh import DistEnv
from scaletrain.resilience.guard import Guard

ENV = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


def _guard(tmp_path, **cfg) -> tuple[Guard, list]:
    events: list = []
    g = Guard(
        ResilienceConfig(**cfg), tmp_path, ENV, None, lambda kind, **kw: events.append(kind), lambda x: x
    )
    return g, events


@pytest.fixture
def transfers(monkeypatch):
    """Counts the device-to-host reads of tensors: item(), tolist() and float()."""
    count = [0]
    for name in ("item", "tolist", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, **k):
            count[0] += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return count


def test_nan_and_spike_checks_read_the_device_once_per_step(tmp_path, transfers):
    guard, _ = _guard(tmp_path, nan_check=True, spike_zscore=3.0, spike_window=20)
    for step in range(1, 13):
        before = transfers[0]
        assert guard.check(step, torch.tensor(3.0 + 0.01 * (step % 2)), torch.tensor(1.0)) == "ok"
        assert transfers[0] - before == 1


def test_decisions_skip_a_non_finite_step_and_roll_back_on_a_spike(tmp_path):
    guard, events = _guard(tmp_path, nan_check=True, spike_zscore=3.0, spike_window=20)
    assert guard.check(1, torch.tensor(math.nan), torch.tensor(1.0)) == "skip"
    for step in range(2, 14):
        assert guard.check(step, torch.tensor(3.0 + 0.01 * (step % 2)), torch.tensor(1.0)) == "ok"
    assert guard.check(14, torch.tensor(9.0), torch.tensor(1.0)) == "rollback"
    assert events == ["skipped_step", "loss_spike"]


def test_no_check_configured_reads_nothing(tmp_path, transfers):
    guard, _ = _guard(tmp_path, nan_check=False)
    assert guard.check(1, torch.tensor(math.nan), torch.tensor(1.0)) == "ok" and transfers[0] == 0
