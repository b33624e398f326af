"""Run metrics: FLOPs and MFU, peak memory, the JSON-lines/TensorBoard writer, the rank-0 progress display and the
mixture-of-experts load monitor."""

from __future__ import annotations

from scaletrain.hardware import cpu_features, cpu_model_name  # re-exported: what benchmarks print
from scaletrain.metrics.memory import peak_memory_mib
from scaletrain.metrics.meter import StepMeter
from scaletrain.metrics.mfu import (
    device_peak_flops,
    flops_per_token,
    measure_cpu_peak,
    measure_matmul_flops,
    mfu,
    over_peak_action,
)
from scaletrain.metrics.moe import MoEMonitor
from scaletrain.metrics.profile import Profiler
from scaletrain.metrics.progress import (
    Progress,
    announce,
    log_line,
    print_summary,
    record_at,
    recorded_evals,
    run_summary,
)
from scaletrain.metrics.writer import MetricsWriter

__all__ = [
    "MetricsWriter",
    "MoEMonitor",
    "Profiler",
    "Progress",
    "StepMeter",
    "announce",
    "cpu_features",
    "cpu_model_name",
    "device_peak_flops",
    "flops_per_token",
    "measure_cpu_peak",
    "measure_matmul_flops",
    "mfu",
    "over_peak_action",
    "peak_memory_mib",
    "log_line",
    "print_summary",
    "record_at",
    "recorded_evals",
    "run_summary",
]
