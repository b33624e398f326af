"""Named model shapes, from a ~1M-parameter debug model to Llama 3.1 405B, their resolution from config, and the
checks of model.* and moe.* as they resolve (model_problems, model_shape_problems, moe_problems; validate composes).

Large presets are only ever built on the meta device (to count parameters); nothing here allocates them.
"""

from __future__ import annotations

import dataclasses
import difflib

import torch

from scaletrain.config import ModelConfig, MoEConfig
from scaletrain.models.deepseek_v3 import DEEPSEEK_V3_PRESETS, deepseek_problems
from scaletrain.models.gpt_oss import GPT_OSS_PRESETS
from scaletrain.models.llama import ModelArgs, Transformer
from scaletrain.models.moe import MOE_FIELDS, is_moe_layer
from scaletrain.models.qwen3 import QWEN3_PRESETS

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
}
# Each family's shapes live in its module (models/<family>.py) and are named here once.
PRESETS |= QWEN3_PRESETS | GPT_OSS_PRESETS | DEEPSEEK_V3_PRESETS


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


# -- checks before launch (validate composes them) ------------------------------------------------------------

_SIZE_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_hidden",
    "vocab_size",
    "rope_original_max_len",
)


def resolvable(m: ModelConfig) -> bool:
    return m.preset in PRESETS and all(getattr(m, n) is None or getattr(m, n) >= 1 for n in _SIZE_FIELDS)


def model_problems(m: ModelConfig) -> list[str]:
    """The model.* fields on their own (model.init_from: checkpoint/hf/core.py's init_from_problems); the shape they
    resolve to is checked by model_shape_problems."""
    if m.preset not in PRESETS:
        near = difflib.get_close_matches(m.preset, list(PRESETS), n=1, cutoff=0.3)
        hint = f" (did you mean '{near[0]}'?)" if near else ""
        return [f"model.preset '{m.preset}' is unknown{hint}; choose one of {', '.join(PRESETS)}"]
    problems = [
        f"model.{name} must be >= 1, got {getattr(m, name)}"
        for name in _SIZE_FIELDS
        if getattr(m, name) is not None and getattr(m, name) < 1
    ]
    if m.head_size is not None and m.head_size < 0:
        problems.append(f"model.head_size must be >= 0 (0: dim / n_heads), got {m.head_size}")
    for name in ("rope_theta", "rope_scaling_factor", "norm_eps", "init_std"):
        v = getattr(m, name)
        if v is not None and v <= 0:
            problems.append(f"model.{name} must be > 0, got {v}")
    return problems


def model_shape_problems(args: ModelArgs, m: ModelConfig, tokenizer_vocab: int | None) -> list[str]:
    """The resolved shape against what attention, RoPE and the embedding need; each message names the field to
    change and says when its value came from the preset rather than from the config."""

    def field(name: str) -> str:
        origin = "" if getattr(m, name) is not None else f" (from model.preset '{m.preset}')"
        return f"model.{name} {getattr(args, name)}{origin}"

    problems = []
    dim, heads, kv = args.dim, args.n_heads, args.n_kv_heads
    if args.head_size:  # heads of their own size (Qwen3, GPT-OSS): dim need not divide
        if args.head_size % 2:
            problems.append(
                f"{field('head_size')} is odd, and RoPE rotates pairs of channels; set model.head_size even"
            )
    elif dim % heads:
        problems.append(
            f"{field('dim')} is not divisible by {field('n_heads')}: each head gets dim / n_heads channels; "
            f"set model.n_heads to one of {_divisors_near(dim, heads, even_quotient=True)} or change model.dim"
        )
    elif (dim // heads) % 2:
        problems.append(
            f"the head size {field('dim')} / {field('n_heads')} = {dim // heads} is odd, and RoPE rotates "
            f"pairs of channels; set model.n_heads to one of {_divisors_near(dim, heads, even_quotient=True)}"
        )
    if heads % kv:
        problems.append(
            f"{field('n_heads')} is not divisible by {field('n_kv_heads')} (grouped-query attention shares each "
            f"key/value head among n_heads / n_kv_heads query heads); set model.n_kv_heads to one of "
            f"{_divisors_near(heads, kv)}"
        )
    problems += deepseek_problems(args)
    if tokenizer_vocab is not None and args.vocab_size < tokenizer_vocab:
        problems.append(
            f"{field('vocab_size')} is smaller than the tokenizer's {tokenizer_vocab} tokens, so some token ids "
            f"have no embedding row; set model.vocab_size >= {tokenizer_vocab}, or leave it unset with a preset "
            "that takes the tokenizer's (debug)"
        )
    return problems


_MOE_SHAPE = (
    "top_k", "hidden", "shared_experts", "router", "norm_topk", "every", "first_dense", "bias", "swiglu_limit",
)  # fmt: skip


def moe_problems(moe: MoEConfig, args: ModelArgs, preset: str) -> list[str]:
    """The MoE shape as resolved (moe.* over the preset) and the MoE training knobs."""

    def field(name: str, value: object) -> str:
        origin = "" if getattr(moe, name) is not None else f" (from model.preset '{preset}')"
        return f"moe.{name} {value}{origin}"

    problems = [
        f"moe.{name} must be >= 0, got {getattr(moe, name)}"
        for name in ("capacity_factor", "aux_loss_coef", "z_loss_coef", "bias_update_rate", "swiglu_limit")
        if (getattr(moe, name) or 0) < 0
    ]
    e, k = args.n_experts, args.top_k
    if e < 0:
        return problems + [f"moe.n_experts must be >= 0 (0: a dense model), got {e}"]
    if e == 0:
        # Refused rather than ignored: a knob that silently does nothing hides a typo'd preset or a lost line.
        unused = [f"moe.{n}" for n in _MOE_SHAPE if getattr(moe, n) is not None]
        unused += ["moe.capacity_factor"] if moe.capacity_factor > 0 else []
        unused += ["moe.bias_update_rate"] if moe.bias_update_rate > 0 else []
        if unused:
            one = len(unused) == 1
            presets = ", ".join(p for p in PRESETS if p != "debug" and PRESETS[p].get("n_experts"))
            problems.append(
                f"{', '.join(unused)} {'is' if one else 'are'} set, but the model is dense "
                f"({field('n_experts', 0)}), so {'it has' if one else 'they have'} no effect; set "
                f"moe.n_experts > 0 or a MoE preset ({presets}), or remove {'it' if one else 'them'}"
            )
        return problems
    if k < 1 or k > e:
        problems.append(
            f"{field('top_k', k)} must be between 1 and {field('n_experts', e)}: each token goes to top_k "
            f"distinct experts; set moe.top_k to at most {e}"
        )
    for name, value in (("hidden", args.moe_hidden), ("every", args.moe_every)):
        if value < 1 and getattr(moe, name) is not None:
            problems.append(f"{field(name, value)} must be >= 1")
    for name, value in (("shared_experts", args.shared_experts), ("first_dense", args.first_dense)):
        if value < 0:
            problems.append(f"{field(name, value)} must be >= 0")
    if args.moe_every >= 1 and not any(is_moe_layer(args, i) for i in range(args.n_layers)):
        problems.append(
            f"no block is MoE: {field('first_dense', args.first_dense)} and {field('every', args.moe_every)} "
            f"leave all {args.n_layers} blocks dense; lower moe.first_dense or moe.every, or set moe.n_experts 0"
        )
    return problems


def _divisors_near(n: int, near: int, even_quotient: bool = False) -> str:
    """Up to three divisors of `n` closest to `near` (with `even_quotient`: only those d with n / d even), for a
    message that suggests values that work."""
    ok = [d for d in range(1, n + 1) if n % d == 0 and (not even_quotient or (n // d) % 2 == 0)]
    return ", ".join(map(str, sorted(sorted(ok, key=lambda d: (abs(d - near), d))[:3]))) or "none"
