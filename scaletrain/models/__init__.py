"""Model code only: no parallelism and no torch.distributed here."""

from scaletrain.models.llama import ModelArgs, Transformer, count_parameters
from scaletrain.models.presets import PRESETS, build_meta_model, resolve_model_args

__all__ = [
    "ModelArgs",
    "Transformer",
    "count_parameters",
    "PRESETS",
    "build_meta_model",
    "resolve_model_args",
]
