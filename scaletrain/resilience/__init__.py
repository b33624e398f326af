"""Resilience: health checks (NaN, loss spikes), hang and straggler detection, preemption, the rollback decision
and fault injection for drills. Both checkpoint tiers (storage and memory) live in scaletrain.checkpoint."""

from scaletrain.resilience.faults import FaultInjector, InjectedFault, label, validate_specs
from scaletrain.resilience.health import NanGuard, SpikeDetector
from scaletrain.resilience.straggler import StragglerMonitor
from scaletrain.resilience.watchdog import HANG_EXIT_CODE, Watchdog

__all__ = [
    "HANG_EXIT_CODE",
    "FaultInjector",
    "InjectedFault",
    "NanGuard",
    "SpikeDetector",
    "StragglerMonitor",
    "Watchdog",
    "label",
    "validate_specs",
]
