"""Hugging Face checkpoints in and out: a shared core (core.py: the export, the whole-model import, every problem an
import would have; files.py: the safetensors files and config.json on disk; sharded.py: each rank reads only its
share) over one state-dict adapter per model family (llama.py, mixtral.py: the HF names, the tensor reshapes and
the config.json fields, nothing else), as torchtitan's state_dict_adapter is laid out."""
