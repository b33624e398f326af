"""Decoding-cache bytes of multi-head latent attention (MLA, models/mla.py) against multi-head and grouped-query
attention with the same query heads and head size (issue 36: "MLA kv-cache bytes vs standard GQA").

Measured: the bytes `generate` leaves in its KVCache after a prompt and new tokens, on the debug DeepSeek-V3
model (MLA) and on the same model with grouped-query attention of 4 query and 2 or 4 kv heads of the qk head size
in its place. Counted: the same per token and layer for DeepSeek-V3's published shape (a cache keeps
kv_lora_rank + qk_rope_head_dim numbers per token and layer; MHA keeps 2 x heads x head size), in bf16.

    python benchmarks/mla_kv_cache.py [--tokens 200]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from scaletrain.config import ModelConfig
from scaletrain.models import build_model, resolve_model_args
from scaletrain.models.kv_cache import KVCache

PROMPT = 16


def cache_bytes(model: torch.nn.Module, tokens: int) -> int:
    """The cache's bytes after a prompt of PROMPT tokens and tokens - PROMPT single-token steps (generate's
    pattern: the cache is allocated for the whole length at the first step)."""
    cache = KVCache(model.args.n_layers, tokens)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.args.vocab_size, (1, PROMPT), generator=gen)
    with torch.no_grad():
        model(x, cache=cache)
        for _ in range(tokens - PROMPT):
            model(torch.randint(0, model.args.vocab_size, (1, 1), generator=gen), cache=cache)
    return sum(t.nbytes for layer in cache.layers.values() for t in (layer.k, layer.v))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=200)
    a = parser.parse_args()
    mla = resolve_model_args(ModelConfig(preset="debug_deepseek_v3"), 256, 256)
    head = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    gqa = {
        f"gqa_{kv}kv": dataclasses.replace(mla, kv_lora_rank=0, q_lora_rank=0, head_size=head, n_kv_heads=kv)
        for kv in (mla.n_heads, 2)
    }
    rows = {}
    for name, args in {"mla": mla, **gqa}.items():
        measured = cache_bytes(build_model(args, seed=0, device="cpu").eval(), a.tokens)
        rows[name] = {"bytes": measured, "per_token_layer": measured / (a.tokens * args.n_layers)}
    v3 = resolve_model_args(ModelConfig(preset="deepseek_v3_671b"), None, 4096)
    v3_head = v3.qk_nope_head_dim + v3.qk_rope_head_dim
    per_token_bf16 = {  # bytes per token and layer
        "mla": 2 * (v3.kv_lora_rank + v3.qk_rope_head_dim),
        "mha_128": 2 * 2 * v3.n_heads * v3_head,
        "gqa_8kv": 2 * 2 * 8 * v3_head,
    }
    print(json.dumps({"debug_fp32": rows, "deepseek_v3_bf16_per_token_layer": per_token_bf16}, indent=1))


if __name__ == "__main__":
    main()
