"""Precision: bf16/fp16 by autocast or FSDP2's MixedPrecisionPolicy, fp16 loss scaling, fp8 (torchao) in this
package's policy, scaler and fp8 modules; quantization-aware training in qat."""

from scaletrain.precision.fp8 import apply_fp8, fp8_problems
from scaletrain.precision.policy import (
    Precision,
    cpu_precision_warning,
    mfu_precision,
    precision_problems,
    resolve_precision,
)
from scaletrain.precision.scaler import LossScaler

__all__ = [
    "LossScaler",
    "Precision",
    "apply_fp8",
    "cpu_precision_warning",
    "fp8_problems",
    "mfu_precision",
    "precision_problems",
    "resolve_precision",
]
