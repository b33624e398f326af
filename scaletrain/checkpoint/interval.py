"""The checkpoint interval that minimises expected lost time (Young 1974; Daly 2006): tau = sqrt(2 * delta * MTBF),
with delta the time a save blocks training and MTBF the mean time between failures."""

from __future__ import annotations

import math


def young_daly_interval_s(delta_s: float, mtbf_s: float) -> float:
    return math.sqrt(2.0 * max(delta_s, 1e-6) * mtbf_s)


def interval_steps(delta_s: float, mtbf_s: float, step_time_s: float) -> int:
    """The Young/Daly interval in whole steps (at least 1)."""
    return max(1, round(young_daly_interval_s(delta_s, mtbf_s) / max(step_time_s, 1e-9)))
