"""GPT-OSS (OpenAI 2025, gpt-oss-120b and gpt-oss-20b model card): the shared Transformer (models/llama.py) with
biased attention whose softmax has a learned sink per head, sliding-window (128) and full attention alternating
from layer 0, and on every block an MoE with a biased router (softmax over its top 4) and biased experts running a
clamped SwiGLU. This module holds the shapes only; HF conversion: checkpoint/hf/gpt_oss.py.

The published sizes use YaRN RoPE (factor 32 over 4096 positions, its range not truncated), as their config.json.
Their checkpoints' MXFP4 experts are refused on import (checkpoint/hf/gpt_oss.py); dequantised ones import."""

from __future__ import annotations

_FEATURES = dict(
    family="gpt_oss", attention_bias=True, attention_sinks=True, moe_bias=True, swiglu_limit=7.0, window_every=2,
    norm_eps=1e-5, rope_theta=150000.0,
)  # fmt: skip
_GPT_OSS = dict(
    _FEATURES, dim=2880, n_heads=64, n_kv_heads=8, head_size=64, ffn_hidden=2880, moe_hidden=2880,
    vocab_size=201088, window=128, top_k=4, rope_scaling="yarn", rope_scaling_factor=32.0, rope_original_max_len=4096,
    rope_yarn_truncate=False,
)  # fmt: skip

GPT_OSS_PRESETS: dict[str, dict] = {
    # head_size 48 with dim 128 and 4 heads: neither dim / n_heads nor a power of two; a window of 16.
    "debug_gpt_oss": dict(
        _FEATURES,
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_size=48,
        ffn_hidden=352,
        vocab_size=None,
        n_experts=8,
        top_k=2,
        moe_hidden=176,
        window=16,
    ),  # fmt: skip
    "gpt_oss_20b": dict(_GPT_OSS, n_layers=24, n_experts=32),
    "gpt_oss_120b": dict(_GPT_OSS, n_layers=36, n_experts=128),
}

# The model card's totals and active parameters (embedding included), in billions.
PUBLISHED = {"gpt_oss_20b": (20.9, 3.6), "gpt_oss_120b": (116.8, 5.1)}
