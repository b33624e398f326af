"""Model code only: no parallelism and no torch.distributed here."""

from scaletrain.models.llama import ModelArgs, Transformer, count_parameters
from scaletrain.models.loss import cross_entropy
from scaletrain.models.presets import PRESETS, build_meta_model, build_model, resolve_model_args

__all__ = [
    "ModelArgs",
    "Transformer",
    "count_parameters",
    "cross_entropy",
    "PRESETS",
    "build_meta_model",
    "build_model",
    "resolve_model_args",
]
