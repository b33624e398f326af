"""Qwen3 (Qwen Team 2025, arXiv 2505.09388): the Llama block with QK-norm and a head size apart from dim / n_heads,
and Qwen3-MoE, whose blocks route each token to the top 8 of 128 softmax-scored experts with normalised weights and
no shared expert. Both are the shared Transformer (models/llama.py) with its feature switches set; this module
holds their shapes only. HF conversion: checkpoint/hf/qwen3.py."""

from __future__ import annotations

_QWEN3 = dict(family="qwen3", qk_norm=True, head_size=128, vocab_size=151936, rope_theta=1e6, norm_eps=1e-6)

# The published shapes (config.json of Qwen/Qwen3-*); parameter counts as the model cards state them, checked on
# the meta device by tests/unit/test_families.py.
QWEN3_PRESETS: dict[str, dict] = {
    # Debug sizes: head_size 64 with dim 128 and 4 heads (not dim / n_heads), so the head size is exercised.
    "debug_qwen3": dict(
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=352,
        vocab_size=None,
        family="qwen3",
        qk_norm=True,
        head_size=64,
        rope_theta=1e6,
        norm_eps=1e-6,
    ),
    "debug_qwen3_moe": dict(
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=352,
        vocab_size=None,
        family="qwen3",
        qk_norm=True,
        head_size=64,
        rope_theta=1e6,
        norm_eps=1e-6,
        n_experts=8,
        top_k=2,
        moe_hidden=176,
        norm_topk=True,
    ),
    "qwen3_0.6b": dict(
        _QWEN3, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden=3072, tie_embeddings=True
    ),
    "qwen3_1.7b": dict(
        _QWEN3, dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden=6144, tie_embeddings=True
    ),
    "qwen3_4b": dict(
        _QWEN3, dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden=9728, tie_embeddings=True
    ),
    "qwen3_8b": dict(_QWEN3, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden=12288),
    "qwen3_14b": dict(_QWEN3, dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_hidden=17408),
    "qwen3_32b": dict(_QWEN3, dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_hidden=25600),
    # Qwen3-MoE: 128 experts, top 8, norm_topk_prob true, every block MoE (intermediate_size unused).
    "qwen3_30b_a3b": dict(
        _QWEN3,
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        ffn_hidden=6144,
        n_experts=128,
        top_k=8,
        moe_hidden=768,
        norm_topk=True,
    ),
    "qwen3_235b_a22b": dict(
        _QWEN3,
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        ffn_hidden=12288,
        n_experts=128,
        top_k=8,
        moe_hidden=1536,
        norm_topk=True,
    ),
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
