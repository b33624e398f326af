"""Named model shapes, from a ~1M-parameter debug model to Llama 3.1 405B, and their resolution from config.

Large presets are only ever built on the meta device (to count parameters); nothing here allocates them.
"""

from __future__ import annotations

import dataclasses

import torch

from scaletrain.config import ModelConfig, MoEConfig
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
    # Mixture-of-experts shapes (docs/moe.md). debug_moe: the debug model with 8 experts, top-2, each expert half
    # the dense hidden size, so a token's active parameters stay close to the dense debug model's.
    "debug_moe": dict(
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=352,
        vocab_size=None,
        n_experts=8,
        top_k=2,
        moe_hidden=176,
    ),
    # Mixtral 8x7B (Jiang et al. 2024): 46.7B total, 12.9B active.
    "mixtral_8x7b": dict(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        vocab_size=32000,
        rope_theta=1e6,
        n_experts=8,
        top_k=2,
    ),
    # DeepSeek-MoE 16B (Dai et al. 2024): fine-grained experts, 64 routed top-6 plus 2 shared, block 0 dense;
    # softmax router without top-k normalisation. 16.4B total, 2.8B active.
    "deepseek_moe_16b": dict(
        dim=2048,
        n_layers=28,
        n_heads=16,
        n_kv_heads=16,
        ffn_hidden=10944,
        vocab_size=102400,
        n_experts=64,
        top_k=6,
        moe_hidden=1408,
        shared_experts=2,
        first_dense=1,
        norm_topk=False,
    ),
    # DeepSeek-V3-like (DeepSeek-AI 2024): 256 routed experts top-8 with sigmoid scores plus 1 shared, the first 3
    # blocks dense. Multi-head latent attention is not implemented: grouped-query attention (128 query and 8 kv
    # heads of 56 dims, ~109M parameters a layer) stands in for MLA (~187M a layer), so this counts ~666B total
    # and ~32B active (without the embedding) where DeepSeek-V3 has 671B and 37B. Neither its multi-token
    # prediction module, its node-limited (grouped) routing nor its routed-weight scale of 2.5 is modelled.
    "deepseek_v3_671b": dict(
        dim=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=8,
        ffn_hidden=18432,
        vocab_size=129280,
        n_experts=256,
        top_k=8,
        moe_hidden=2048,
        shared_experts=1,
        first_dense=3,
        router="sigmoid",
    ),
}

# MoEConfig field -> ModelArgs field where the names differ; the rest keep their name.
MOE_FIELDS = {"hidden": "moe_hidden", "every": "moe_every"}


def pad_vocab(n: int, multiple: int = 64) -> int:
    # A multiple of 64 keeps the embedding and output matmuls aligned and divisible by common TP sizes.
    return -(-n // multiple) * multiple


def resolve_model_args(
    cfg: ModelConfig, tokenizer_vocab: int | None, max_seq_len: int, moe: MoEConfig | None = None
) -> ModelArgs:
    """The preset, overridden by every model.* field that is set, and by every moe.* field that is set."""
    values = dict(PRESETS[cfg.preset])
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if f.name != "preset" and v is not None and f.name in {x.name for x in dataclasses.fields(ModelArgs)}:
            values[f.name] = v
    if moe is not None:
        for f in dataclasses.fields(moe):
            name, v = MOE_FIELDS.get(f.name, f.name), getattr(moe, f.name)
            if v is not None and name in {x.name for x in dataclasses.fields(ModelArgs)}:
                values[name] = v
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
