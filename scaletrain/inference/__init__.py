"""Inference on one process: load a run's newest checkpoint or a Hugging Face directory (`load_model`), sample from
it with a KV cache (`generate`), and measure its loss over text packed as in training (`evaluate_text`)."""

from scaletrain.inference.evaluate import EvalResult, evaluate_text, mean_loss, token_stream
from scaletrain.inference.generate import Generation, generate, generate_text, sample_line
from scaletrain.inference.loader import LoadedModel, load_model, resolve_device

__all__ = [
    "EvalResult",
    "Generation",
    "LoadedModel",
    "evaluate_text",
    "generate",
    "generate_text",
    "load_model",
    "mean_loss",
    "resolve_device",
    "sample_line",
    "token_stream",
]
