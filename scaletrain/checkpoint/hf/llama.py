"""The Llama state-dict adapter: our tensor names to Hugging Face's `LlamaForCausalLM` and back, its config.json
to and from our model's fields, and the RoPE variants our model computes identically. Our attention uses HF's
rotate-half RoPE layout, so the weights map one to one; only the names differ. A Mixtral is this with an MoE
feed-forward (mixtral.py)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from scaletrain.errors import UserError

if TYPE_CHECKING:
    from scaletrain.models.llama import ModelArgs

ARCHITECTURE = "LlamaForCausalLM"

_LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}

LAYER = re.compile(r"model\.layers\.(?P<i>\d+)\.(?P<module>.+)\.(?P<leaf>\w+)")

# The config.json fields an import cannot do without.
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def to_hf_name(name: str) -> str:
    if name == "tok_embeddings.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    _, i, rest = name.split(".", 2)
    module, leaf = rest.rsplit(".", 1)
    return f"model.layers.{i}.{_LAYER_NAMES[module]}.{leaf}"


def from_hf_name(name: str) -> str:
    reverse = {v: k for k, v in _LAYER_NAMES.items()}
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = LAYER.fullmatch(name)
    if m is None or m["module"] not in reverse:
        raise UserError(f"unexpected tensor '{name}' in the Hugging Face checkpoint (not a Llama weight)")
    return f"layers.{m['i']}.{reverse[m['module']]}.{m['leaf']}"


def read_rope(cfg: dict, default_theta: float, yarn: bool = False) -> tuple[dict, list[str]]:
    """(model.rope_* fields, problems). transformers >= 5 writes rope_parameters (rope_theta inside it); earlier
    versions, and our export, write rope_theta and rope_scaling. Accepted is what our model computes identically:
    plain RoPE, Llama 3.1's scaling with its low_freq_factor 1 and high_freq_factor 4 (models/llama.py), and with
    `yarn` (a family whose export writes it: GPT-OSS) YaRN with its default betas and mscale."""
    key = "rope_parameters" if "rope_parameters" in cfg else "rope_scaling"
    rope = dict(cfg.get(key) or {})
    theta = rope.get("rope_theta", cfg.get("rope_theta", default_theta))
    fields = {"rope_theta": float(theta), "rope_scaling": "none"}
    kind = rope.get("rope_type", rope.get("type", "default"))
    supported = (
        "our model computes RoPE unscaled (rope_type 'default') or with Llama 3.1's scaling (rope_type 'llama3', "
        "low_freq_factor 1.0, high_freq_factor 4.0), so these weights would run with other frequencies"
    )
    if kind == "default":
        return fields, []
    if kind == "yarn" and yarn:
        return _read_yarn(rope, key, fields)
    if kind != "llama3":
        return fields, [f"config.json: {key}.rope_type {kind!r} is not supported; {supported}"]
    problems = [
        f"config.json: {key}.{name} {rope[name]} is not {ours}; {supported}"
        for name, ours in (("low_freq_factor", 1.0), ("high_freq_factor", 4.0))
        if float(rope.get(name, ours)) != ours
    ]
    missing = [k for k in ("factor", "original_max_position_embeddings") if k not in rope]
    if missing:
        problems.append(f"config.json: {key} (rope_type 'llama3') lacks {', '.join(missing)}")
        return fields, problems
    fields.update(
        rope_scaling="llama3",
        rope_scaling_factor=float(rope["factor"]),
        rope_original_max_len=int(rope["original_max_position_embeddings"]),
    )
    return fields, problems


def _read_yarn(rope: dict, key: str, fields: dict) -> tuple[dict, list[str]]:
    """YaRN as models/llama._yarn computes it: beta_fast 32, beta_slow 1, cos and sin scaled by 0.1 ln(factor) + 1
    (no attention_factor, mscale or partial rotary of its own)."""
    # Here, not at the top: a module-level import would lengthen the import chain past test_layering's bound.
    from scaletrain.models.llama import YARN_BETA_FAST, YARN_BETA_SLOW

    why = "our YaRN has beta_fast 32, beta_slow 1 and scales cos/sin by 0.1 ln(factor) + 1"
    problems = [
        f"config.json: {key}.{name} {rope[name]} is not {ours}; {why}"
        for name, ours in (
            ("beta_fast", YARN_BETA_FAST),
            ("beta_slow", YARN_BETA_SLOW),
            ("partial_rotary_factor", 1),
        )
        if rope.get(name) is not None and float(rope[name]) != ours
    ]
    problems += [
        f"config.json: {key}.{name} is set; {why}"
        for name in ("attention_factor", "mscale", "mscale_all_dim")
        if rope.get(name)
    ]
    missing = [k for k in ("factor", "original_max_position_embeddings") if k not in rope]
    if missing:
        return fields, problems + [f"config.json: {key} (rope_type 'yarn') lacks {', '.join(missing)}"]
    fields.update(
        rope_scaling="yarn",
        rope_scaling_factor=float(rope["factor"]),
        rope_original_max_len=int(rope["original_max_position_embeddings"]),
        rope_yarn_truncate=bool(rope.get("truncate", True)),
    )
    return fields, problems


def config_json(args: ModelArgs, eod_id: int | None = None) -> dict:
    """config.json of a Llama (a Mixtral's adds its own entries over these: core.hf_config)."""
    cfg = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if args.rope_scaling == "llama3":
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": args.rope_scaling_factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": args.rope_original_max_len,
        }
    if eod_id is not None:
        cfg["eos_token_id"] = cfg["bos_token_id"] = eod_id  # see files.tokenizer_config
    return cfg


def read_config(cfg: dict) -> tuple[dict, list[str]]:
    """(ModelArgs fields, problems) of the Llama entries of a config.json (a Mixtral's too) but RoPE's (read_rope):
    every field our model would compute differently (biases, another activation or head size) is a problem."""
    kind = cfg.get("model_type")
    missing = [k for k in REQUIRED if k not in cfg]
    if missing:
        return {}, [f"config.json lacks {', '.join(missing)}; is it a complete {kind.title()} config?"]
    problems = [
        f"config.json: {flag} is true, but our Llama has no biases, so they would be dropped; only bias-free "
        "Llama checkpoints import"
        for flag in ("attention_bias", "mlp_bias")
        if cfg.get(flag)
    ]
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(
            f"config.json: hidden_act {cfg['hidden_act']!r} is not supported; our MLP is SwiGLU (hidden_act 'silu')"
        )
    fields = {
        "dim": cfg["hidden_size"],
        "n_layers": cfg["num_hidden_layers"],
        "n_heads": cfg["num_attention_heads"],
        "n_kv_heads": cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        "ffn_hidden": cfg["intermediate_size"],
        "vocab_size": cfg["vocab_size"],
        "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),  # LlamaConfig's default
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        # An explicit head_dim (Qwen3, GPT-OSS; Llama allows one too): 0 when it is hidden_size / heads.
        "head_size": int(cfg.get("head_dim") or 0)
        if cfg.get("head_dim") not in (None, cfg["hidden_size"] // cfg["num_attention_heads"])
        else 0,
    }
    return fields, problems


def tensor_names(n_layers: int, moe: bool = False) -> set[str]:
    """The HF names of a Llama's tensors; with `moe` without the MLP's (a Mixtral's experts: mixtral.layer_names)."""
    per_layer = [f"{m}.weight" for m in _LAYER_NAMES.values() if not (moe and m.startswith("mlp."))]
    return set(_GLOBAL_NAMES) | {f"model.layers.{i}.{n}" for i in range(n_layers) for n in per_layer}
