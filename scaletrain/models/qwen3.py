"""Qwen3 (Qwen Team 2025, arXiv 2505.09388): the Llama block with QK-norm and a head size apart from dim / n_heads,
and Qwen3-MoE, whose blocks route each token to the top 8 of 128 softmax-scored experts with normalised weights and
no shared expert. Both are the shared Transformer (models/llama.py) with its feature switches set; this module
holds their shapes only. HF conversion: checkpoint/hf/qwen3.py."""

from __future__ import annotations

_QWEN3 = dict(family="qwen3", qk_norm=True, rope_theta=1e6, norm_eps=1e-6)
# Qwen3-MoE: 128 experts, top 8, norm_topk_prob true, every block MoE (intermediate_size unused).
_MOE = dict(n_experts=128, top_k=8, norm_topk=True)


def _shape(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_hidden: int, **rest) -> dict:
    """One published Qwen3 (head size 128, vocabulary 151936) from a row of the table below."""
    shape = dict(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_hidden=ffn_hidden)
    return dict(_QWEN3, head_size=128, vocab_size=151936, **shape, **rest)


# Debug sizes: head_size 64 with dim 128 and 4 heads (not dim / n_heads), so the head size is exercised.
_DEBUG = dict(
    _QWEN3, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=352, vocab_size=None, head_size=64
)

# The published shapes (config.json of Qwen/Qwen3-*); parameter counts as the model cards state them, checked on
# the meta device by tests/unit/test_families.py.
QWEN3_PRESETS: dict[str, dict] = {
    "debug_qwen3": _DEBUG,
    "debug_qwen3_moe": dict(_DEBUG, n_experts=8, top_k=2, moe_hidden=176, norm_topk=True),
    # Each row: _shape(dim, n_layers, n_heads, n_kv_heads, ffn_hidden, other fields).
    "qwen3_0.6b": _shape(1024, 28, 16, 8, 3072, tie_embeddings=True),
    "qwen3_1.7b": _shape(2048, 28, 16, 8, 6144, tie_embeddings=True),
    "qwen3_4b": _shape(2560, 36, 32, 8, 9728, tie_embeddings=True),
    "qwen3_8b": _shape(4096, 36, 32, 8, 12288),
    "qwen3_14b": _shape(5120, 40, 40, 8, 17408),
    "qwen3_32b": _shape(5120, 64, 64, 8, 25600),
    "qwen3_30b_a3b": _shape(2048, 48, 32, 4, 6144, moe_hidden=768, **_MOE),
    "qwen3_235b_a22b": _shape(4096, 94, 64, 4, 12288, moe_hidden=1536, **_MOE),
}

# Published totals and active counts (model cards: "Number of Parameters", "Activated"), in billions.
PUBLISHED = {
    "qwen3_0.6b": (0.6, None),
    "qwen3_1.7b": (1.7, None),
    "qwen3_4b": (4.0, None),
    "qwen3_8b": (8.2, None),
    "qwen3_14b": (14.8, None),
    "qwen3_32b": (32.8, None),
    "qwen3_30b_a3b": (30.5, 3.3),
    "qwen3_235b_a22b": (235.0, 22.0),
}
