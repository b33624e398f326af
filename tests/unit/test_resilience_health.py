"""NanGuard decisions and SpikeDetector statistics."""

from __future__ import annotations

import math

import pytest
import torch

from scaletrain.resilience.health import NanGuard, SpikeDetector

NAN, INF = math.nan, math.inf


def test_nan_guard_skips_then_rolls_back_after_a_streak():
    g = NanGuard(rollback_after=3)
    assert g.check(2.0, 1.0) == "ok"
    assert [g.check(NAN, 1.0), g.check(2.0, INF), g.check(NAN, NAN)] == ["skip", "skip", "rollback"]
    assert g.skipped_total == 3
    # The rollback starts a new streak: two more bad steps are skips again.
    assert [g.check(NAN, 1.0), g.check(NAN, 1.0)] == ["skip", "skip"]
    assert g.skipped_total == 5


def test_nan_guard_a_finite_step_resets_the_streak():
    g = NanGuard(rollback_after=2)
    assert g.check(NAN, 1.0) == "skip"
    assert g.check(1.5, 0.5) == "ok"
    assert g.check(-INF, 1.0) == "skip"  # not a rollback: the streak was broken
    assert g.streak == 1 and g.skipped_total == 2


def test_nan_guard_never_rolls_back_when_disabled_and_takes_tensors():
    g = NanGuard(rollback_after=0)
    assert {g.check(torch.tensor(NAN), torch.tensor(1.0)) for _ in range(10)} == {"skip"}
    assert g.check(torch.tensor(1.0), torch.tensor(2.0)) == "ok"
    assert g.skipped_total == 10 and g.streak == 0


def test_detectors_are_not_checkpointed():
    # Their state does not survive a restart (stated in health.py); nothing pretends it does.
    assert not hasattr(NanGuard(3), "state_dict") and not hasattr(SpikeDetector(10, 3.0), "state_dict")


def _warm(det: SpikeDetector, n: int, base: float = 3.0) -> None:
    for i in range(n):
        assert not det.observe(base + 0.01 * ((-1) ** i))


def test_spike_detector_flags_a_jump_and_keeps_it_out_of_the_statistics():
    det = SpikeDetector(window=20, zscore=4.0)
    _warm(det, 20)
    mean, std = det.mean, det.std
    assert det.observe(3.5)  # 50 standard deviations above
    assert (det.mean, det.std) == (mean, std)  # the spike did not join the window
    assert not det.observe(3.005)  # ordinary noise is not a spike
    assert not det.observe(2.5)  # a drop never is


def test_spike_detector_waits_for_min_history():
    det = SpikeDetector(window=50, zscore=3.0)
    assert det.min_history == 10
    _warm(det, 9)
    assert not det.observe(100.0)  # only 9 losses seen: no judgement, even of an absurd value
    det2 = SpikeDetector(window=4, zscore=3.0)
    assert det2.min_history == 4
    _warm(det2, 4)
    assert det2.observe(100.0)


def test_spike_detector_window_forgets_old_losses():
    det = SpikeDetector(window=10, zscore=3.0)
    _warm(det, 10, base=6.0)
    for i in range(10):  # a gradual fall, each step within noise of the last
        det.observe(6.0 - 0.1 * (i + 1) + 0.01 * ((-1) ** i))
    assert det.mean < 5.6  # the 6.0 losses have left the window
    assert det.observe(6.5)


def test_spike_detector_ignores_non_finite_and_flat_losses():
    det = SpikeDetector(window=10, zscore=3.0)
    for _ in range(10):
        det.observe(2.0)
    assert not det.observe(NAN)
    assert not det.observe(2.0 + 1e-9)  # flat history: rounding is not a spike
    assert det.observe(2.1)


def test_spike_detector_rejects_a_window_too_small():
    with pytest.raises(ValueError, match="window"):
        SpikeDetector(window=1, zscore=3.0)
