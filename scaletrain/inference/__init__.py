"""Inference on one process: load a run's newest checkpoint or a Hugging Face directory (`load_model`), sample from
it with a KV cache (`generate`), and measure its loss over text packed as in training (`evaluate_text`)."""

from scaletrain.inference.evaluate import EvalResult, evaluate_text, mean_loss, token_stream
from scaletrain.inference.generate import Generation, Sample, generate, generate_text, record_samples
from scaletrain.inference.loader import LoadedModel, load_model, resolve_device

__all__ = [
    "EvalResult",
    "Generation",
    "LoadedModel",
    "Sample",
    "evaluate_text",
    "generate",
    "generate_text",
    "load_model",
    "mean_loss",
    "record_samples",
    "resolve_device",
    "token_stream",
]
