"""One unsharded model for inference, from a run directory (its newest committed checkpoint, in whatever parallel
layout it was saved: DCP reshards it to one process) or from a Hugging Face directory (a family of docs/models.md), with its
tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from scaletrain.checkpoint.hf.core import args_from_hf_config, hf_dir_problems
from scaletrain.checkpoint.hf.sharded import load_hf_sharded
from scaletrain.checkpoint.run_model import is_checkpoint_dir, load_run_model
from scaletrain.data import Tokenizer, load_tokenizer
from scaletrain.errors import ConfigError, UserError
from scaletrain.hardware import cuda_available, uses_cuda
from scaletrain.models import ModelArgs, Transformer, build_meta_model
from scaletrain.models.attention import AttentionKernel
from scaletrain.run.directory import CONFIG

# LlamaConfig's default, for a config.json that names no context length.
_HF_DEFAULT_CONTEXT = 2048


@dataclass
class LoadedModel:
    """A model ready for `generate` / `evaluate_text`: fp32, in eval mode, on the device asked for."""

    model: Transformer
    tokenizer: Tokenizer
    args: ModelArgs
    """The model's shape; args.max_seq_len is its context (data.seq_len of a run, max_position_embeddings of an
    HF directory)."""
    source: str
    """What was read: the checkpoint directory of a run, or the HF directory."""
    document_mask: bool = False
    """Trained with data.document_mask: evaluation masks attention at document boundaries as training did."""


def resolve_device(name: str) -> torch.device:
    """--device: cpu, cuda, or auto (CUDA when available)."""
    if name == "auto":
        return torch.device("cuda" if uses_cuda(name) else "cpu")
    if name == "cuda" and not cuda_available():
        raise UserError("--device cuda: no CUDA device is available here; use --device cpu")
    if name not in ("cpu", "cuda"):
        raise UserError(f"--device {name!r}: choose cpu, cuda or auto")
    return torch.device(name)


def load_model(path: str | Path, tokenizer: str | None = None, device: str = "cpu") -> LoadedModel:
    """The model of a run directory (or of one checkpoint inside it) or of a Hugging Face directory (a family of docs/models.md).

    tokenizer: 'byte' or a tokenizer.json, instead of the run's data.tokenizer or the HF directory's tokenizer.json
    (an HF directory without one needs it). device: cpu, cuda or auto. Bad input raises UserError saying what to
    give instead."""
    path = Path(path).expanduser().absolute()  # resolved as it enters: what every later message names
    if not path.exists():
        raise UserError(
            f"{path} does not exist; give a run directory or a Hugging Face directory (a family of docs/models.md)"
        )
    target = resolve_device(device)  # checked before anything is read
    if is_checkpoint_dir(path) or (path / CONFIG).is_file():
        # Materialised on the device and read into there: no full copy on the host first.
        model, cfg, tok, ckpt = load_run_model(path, target)
        loaded = LoadedModel(model, tok, model.args, str(ckpt), cfg.data.document_mask)
    elif (path / "config.json").is_file():
        loaded = _load_hf(path, target)
    else:
        raise UserError(
            f"{path} is neither a run directory (it has no config.toml) nor a Hugging Face directory (a family of docs/models.md) (no "
            "config.json); give the --run.dir of a training run or an export of `scaletrain convert --to hf`"
        )
    if tokenizer is not None:
        loaded.tokenizer = load_tokenizer(tokenizer)
    elif loaded.tokenizer is None:
        raise UserError(
            f"{path} has no tokenizer.json; pass --tokenizer with the tokenizer the model was trained with "
            "('byte' or the path of a tokenizer.json)"
        )
    if loaded.tokenizer.vocab_size > loaded.args.vocab_size:
        raise UserError(
            f"the tokenizer has {loaded.tokenizer.vocab_size} tokens but the model only {loaded.args.vocab_size}; "
            "pass the --tokenizer the model was trained with"
        )
    _plain_attention(loaded.model)
    loaded.model.eval()
    return loaded


def _load_hf(path: Path, device: torch.device) -> LoadedModel:
    """The model materialised on `device`, each tensor read from the safetensors files into its parameter one at a
    time (load_hf_sharded on a whole model): no full copy of the weights beside the model."""
    problems = hf_dir_problems(path)
    if problems:
        raise ConfigError(problems)
    cfg = json.loads((path / "config.json").read_text())
    context = int(cfg.get("max_position_embeddings") or _HF_DEFAULT_CONTEXT)
    args = ModelArgs(**args_from_hf_config(cfg), max_seq_len=context)
    model = build_meta_model(args)
    model.to_empty(device=device)
    model.init_weights()  # the RoPE buffers; every weight is read over
    load_hf_sharded([model], path, args)
    tok_file = path / "tokenizer.json"
    tok = load_tokenizer(str(tok_file)) if tok_file.is_file() else None
    return LoadedModel(model, tok, args, str(path))  # type: ignore[arg-type]  # None: load_model asks for one


def _plain_attention(model: Transformer) -> None:
    """Let torch pick the attention kernel (model.attention = auto): a kernel forced for training (flash, cudnn)
    may refuse fp32 or the offset mask of cached decoding, and the kernel does not change what is computed."""
    model.args.attention = "auto"
    for layer in model.layers.values():
        layer.attention.sdpa = AttentionKernel("auto")
