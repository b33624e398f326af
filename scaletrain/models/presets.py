"""Named model shapes, from a ~1M-parameter debug model to Llama 3.1 405B, and their resolution from config.

Large presets are only ever built on the meta device (to count parameters); nothing here allocates them.
"""

from __future__ import annotations

import dataclasses

import torch

from scaletrain.config import ModelConfig
from scaletrain.models.llama import ModelArgs, Transformer

_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, rope_scaling="llama3")

# Shapes of the published models (Touvron et al. 2023; Llama 3 herd, Dubey et al. 2024); vocab_size None means
# "take the tokenizer's".
PRESETS: dict[str, dict] = {
    "debug": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=352, vocab_size=None),
    "125M": dict(
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=12,
        ffn_hidden=2048,
        vocab_size=50304,
        tie_embeddings=True,
    ),
    "1B": dict(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=8192,
        tie_embeddings=True,
        **{**_LLAMA3, "rope_scaling_factor": 32.0},
    ),
    "8B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, **_LLAMA3),
    "70B": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672, **_LLAMA3),
    "405B": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden=53248, **_LLAMA3),
}


def pad_vocab(n: int, multiple: int = 64) -> int:
    # A multiple of 64 keeps the embedding and output matmuls aligned and divisible by common TP sizes.
    return -(-n // multiple) * multiple


def resolve_model_args(cfg: ModelConfig, tokenizer_vocab: int | None, max_seq_len: int) -> ModelArgs:
    """The preset, overridden by every model.* field that is set."""
    values = dict(PRESETS[cfg.preset])
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if f.name != "preset" and v is not None and f.name in {x.name for x in dataclasses.fields(ModelArgs)}:
            values[f.name] = v
    if values.get("vocab_size") is None:
        values["vocab_size"] = pad_vocab(tokenizer_vocab or 256)
    if cfg.rope_scaling is not None:
        values["rope_scaling"] = cfg.rope_scaling
    values["max_seq_len"] = max_seq_len
    return ModelArgs(**values)


def build_meta_model(args: ModelArgs) -> Transformer:
    """The model with no storage: shapes only, for counting and for sharding before materialising."""
    with torch.device("meta"):
        return Transformer(args)


def build_model(args: ModelArgs, seed: int, device: torch.device | str) -> Transformer:
    """The whole model materialised with the seed before any sharding, so that every parallel layout starts from
    the same weights as the single-process run (what makes layouts comparable step by step)."""
    model = build_meta_model(args)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    model.init_weights(device)
    return model
