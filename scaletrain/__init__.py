"""scaletrain: PyTorch-native pre-training of Llama-style language models."""

__version__ = "0.1.0"
