"""Resilience: health checks (NaN, loss spikes), hang and straggler detection, and fault injection for drills."""

from scaletrain.resilience.faults import FaultInjector, FaultSpec, InjectedFault, parse_specs, validate_specs
from scaletrain.resilience.health import NanGuard, SpikeDetector, skip_update
from scaletrain.resilience.straggler import StragglerMonitor
from scaletrain.resilience.watchdog import HANG_EXIT_CODE, CollectiveTracker, Watchdog, append_event

__all__ = [
    "HANG_EXIT_CODE",
    "CollectiveTracker",
    "FaultInjector",
    "FaultSpec",
    "InjectedFault",
    "NanGuard",
    "SpikeDetector",
    "StragglerMonitor",
    "Watchdog",
    "append_event",
    "parse_specs",
    "skip_update",
    "validate_specs",
]
