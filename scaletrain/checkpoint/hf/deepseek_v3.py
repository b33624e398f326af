"""The DeepSeek-V3 state-dict adapter (checkpoint/hf/families.py's contract): our MLA blocks and DeepSeek-MoE
feed-forwards to transformers' `DeepseekV3ForCausalLM` and back, and its config.json. The embedding, the block
norms, the dense feed-forwards and the output keep Llama's names (llama.py).

Names on disk: DeepSeek's Hub checkpoints and `save_pretrained`'s default keep one tensor per expert
(`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`); transformers >= 5 fuses them in memory
(`mlp.experts.gate_up_proj` [E, 2H, D], `mlp.experts.down_proj` [E, D, H]). We write the Hub layout and read both.
The routing bias is `mlp.gate.e_score_correction_bias`: the auxiliary-loss-free balancing's bias, as in V3.
"""

from __future__ import annotations

import re

import torch

from scaletrain.checkpoint.hf import llama
from scaletrain.checkpoint.hf.files import Source
from scaletrain.models.llama import ModelArgs, Transformer
from scaletrain.models.moe import is_moe_layer

NAME = "DeepSeek-V3"
MODEL_TYPES = ("deepseek_v3",)
ARCHITECTURE = "DeepseekV3ForCausalLM"

_ATTENTION = {
    "wq": "q_proj",
    "wq_a": "q_a_proj",
    "q_norm": "q_a_layernorm",
    "wq_b": "q_b_proj",
    "wkv_a": "kv_a_proj_with_mqa",
    "kv_norm": "kv_a_layernorm",
    "wkv_b": "kv_b_proj",
    "wo": "o_proj",
}
# Our MoE entries (under feed_forward.) -> theirs (under mlp.), but the stacked experts.
_MOE = {
    "router.gate.weight": "gate.weight",
    "router.expert_bias": "gate.e_score_correction_bias",
    "shared.w1.weight": "shared_experts.gate_proj.weight",
    "shared.w2.weight": "shared_experts.down_proj.weight",
    "shared.w3.weight": "shared_experts.up_proj.weight",
}
_EXPERT = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_OURS = re.compile(r"layers\.(?P<i>\d+)\.(?P<part>attention|feed_forward)\.(?P<rest>.+)")


def architecture(args: ModelArgs) -> str:
    return ARCHITECTURE


# -- export ---------------------------------------------------------------------------------------------------------


def export_config(args: ModelArgs, eod_id: int | None = None) -> dict:
    """config.json of a DeepseekV3ForCausalLM. A model without MoE blocks is written with every layer dense
    (first_k_dense_replace = num_hidden_layers)."""
    moe = args.n_experts > 0
    cfg = llama.config_json(args, eod_id)
    for key in ("head_dim", "mlp_bias"):  # DeepseekV3Config derives head_dim (the rotary part); no mlp_bias
        del cfg[key]
    cfg |= {
        "architectures": [ARCHITECTURE],
        "model_type": "deepseek_v3",
        "num_key_value_heads": args.n_heads,  # MLA has no kv heads; transformers expands the latent to all
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "rope_interleave": True,  # models/mla.py rotates interleaved pairs, as DeepSeek's weights are laid out
        "n_routed_experts": args.n_experts if moe else 1,
        "num_experts_per_tok": args.top_k if moe else 1,
        "moe_intermediate_size": (args.moe_hidden or args.ffn_hidden) if moe else args.ffn_hidden,
        "n_shared_experts": args.shared_experts if moe else 1,
        "first_k_dense_replace": args.first_dense if moe else args.n_layers,
        "n_group": args.n_group if moe else 1,
        "topk_group": args.topk_group if moe else 1,
        "routed_scaling_factor": args.route_scale,
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 0,
    }
    return cfg


def export_problems(args: ModelArgs, buffers: dict[str, torch.Tensor]) -> list[str]:
    """What DeepseekV3ForCausalLM cannot represent, each with the field (the routing bias it has)."""
    arch = ARCHITECTURE
    checks = [
        (
            not args.mla,
            f"model.kv_lora_rank is 0; {arch} has multi-head latent attention (set kv_lora_rank > 0)",
        ),
        (args.qk_norm, f"model.qk_norm is true; {arch} has no QK-norm"),
        (args.window > 0, f"model.window is {args.window}; {arch} has no sliding window"),
        (
            args.mtp_depth > 0,
            f"model.mtp_depth is {args.mtp_depth}; {arch} has no multi-token prediction module (DeepSeek's release "
            "stores one as an extra layer that transformers skips), and exporting it is not implemented: export a "
            "run without it",
        ),
    ]
    if args.n_experts > 0:
        checks += [
            (args.router != "sigmoid", f"moe.router is {args.router!r}; {arch} scores experts by sigmoids"),
            (
                args.moe_every != 1,
                f"moe.every is {args.moe_every}; {arch}'s blocks past the dense ones are all MoE",
            ),
            (args.shared_experts < 1, f"moe.shared_experts is 0; {arch} has at least one shared expert"),
            (
                args.capacity_factor > 0,
                f"moe.capacity_factor is {args.capacity_factor}; {arch} is dropless, so tokens this model drops "
                "would reach their experts there",
            ),
        ]
    return [msg for bad, msg in checks if bad]


def export_tensors(
    args: ModelArgs, name: str, value: torch.Tensor, read: object = None
) -> dict[str, torch.Tensor]:
    """The HF tensors of one of our entries: MLA's and the MoE's renamed, the stacked experts one per expert."""
    if args.tie_embeddings and name == "output.weight":
        return {}
    m = _OURS.fullmatch(name)
    if m is None or (m["part"] == "feed_forward" and not is_moe_layer(args, int(m["i"]))):
        return {llama.to_hf_name(name): value}  # embedding, norms, output, dense SwiGLU
    prefix = f"model.layers.{m['i']}"
    rest = m["rest"]
    if m["part"] == "attention":
        module, leaf = rest.rsplit(".", 1)
        return {f"{prefix}.self_attn.{_ATTENTION[module]}.{leaf}": value}
    if rest in _MOE:
        return {f"{prefix}.mlp.{_MOE[rest]}": value}
    w = _EXPERT[rest.split(".")[1]]  # experts.w1 -> gate_proj
    return {f"{prefix}.mlp.experts.{e}.{w}.weight": value[e].contiguous() for e in range(value.shape[0])}


# -- import ---------------------------------------------------------------------------------------------------------


def import_config(cfg: dict) -> tuple[dict, list[str]]:
    """(ModelArgs fields, problems) of a DeepSeek-V3 config.json: a problem for whatever our model would compute
    differently (YaRN RoPE, non-interleaved rotary weights, biases, unnormalised top-k weights)."""
    required = (*llama.REQUIRED, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    missing = [k for k in required if k not in cfg]
    if missing:
        return {}, [f"config.json lacks {', '.join(missing)}; is it a complete DeepSeek-V3 config?"]
    rope, problems = llama.read_rope(cfg, 10000.0)
    if cfg.get("attention_bias"):
        problems.append("config.json: attention_bias is true; our MLA has no biases")
    if not cfg.get("rope_interleave", True):
        problems.append(
            "config.json: rope_interleave is false; our MLA rotates interleaved pairs (DeepSeek's)"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"config.json: hidden_act {cfg['hidden_act']!r} is not supported; our MLP is SwiGLU")
    if not cfg.get("norm_topk_prob", True):
        problems.append(
            "config.json: norm_topk_prob is false; our sigmoid router always normalises the top k"
        )
    n_layers = int(cfg["num_hidden_layers"])
    first_dense = int(cfg.get("first_k_dense_replace", 3))
    n_experts = int(cfg.get("n_routed_experts", 256)) if first_dense < n_layers else 0
    fields = {
        "family": "deepseek_v3",
        "dim": cfg["hidden_size"],
        "n_layers": n_layers,
        "n_heads": cfg["num_attention_heads"],
        "n_kv_heads": cfg["num_attention_heads"],
        "ffn_hidden": cfg["intermediate_size"],
        "vocab_size": cfg["vocab_size"],
        "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        **rope,
        "q_lora_rank": int(cfg.get("q_lora_rank") or 0),
        "kv_lora_rank": int(cfg["kv_lora_rank"]),
        "qk_nope_head_dim": int(cfg["qk_nope_head_dim"]),
        "qk_rope_head_dim": int(cfg["qk_rope_head_dim"]),
        "v_head_dim": int(cfg["v_head_dim"]),
        "n_experts": n_experts,
        "window": 0,
    }
    if n_experts:
        fields |= {
            "top_k": int(cfg.get("num_experts_per_tok", 8)),
            "moe_hidden": int(cfg.get("moe_intermediate_size", 2048)),
            "shared_experts": int(cfg.get("n_shared_experts", 1)),
            "router": "sigmoid",
            "norm_topk": True,
            "moe_every": 1,
            "first_dense": first_dense,
            "capacity_factor": 0.0,
            # A training choice, not the weights': DeepSeek-V3's sequence-wise balance loss weight (alpha, its
            # section 2.1.2; the same per-sequence sum f_e P_e as ours), beside the bias update.
            "aux_loss_coef": 0.0001,
            "n_group": int(cfg.get("n_group") or 1),
            "topk_group": int(cfg.get("topk_group") or 1),
            "route_scale": float(cfg.get("routed_scaling_factor", 1.0)),
        }
    return fields, problems


def _fused(names: set[str], i: int) -> bool:
    return f"model.layers.{i}.mlp.experts.gate_up_proj" in names


def import_names(args: ModelArgs, names: set[str]) -> set[str]:
    """Every HF tensor name a checkpoint of this shape holds (each MoE layer's experts in the layout it has)."""
    out = set()
    with torch.device("meta"):  # shapes only (presets.build_meta_model, without its import chain)
        model = Transformer(args)
    for k, v in model.state_dict().items():
        m = _OURS.fullmatch(k)
        if m and m["rest"].startswith("experts.") and _fused(names, int(m["i"])):
            out |= set(import_source(args, k, names).names)
        else:
            out |= set(export_tensors(args, k, v))
    return out


def import_source(args: ModelArgs, name: str, names: set[str]) -> Source:
    """Where our entry `name` is read from: renamed, or for stacked experts one tensor per expert (Hub layout)
    or a half of the fused gate_up_proj."""
    if name == "output.weight" and args.tie_embeddings:
        return Source(["model.embed_tokens.weight"])
    m = _OURS.fullmatch(name)
    if m is None or not m["rest"].startswith("experts."):
        (hf,) = export_tensors(args, name, torch.empty(0, device="meta"))
        return Source([hf])
    i, w = m["i"], m["rest"].split(".")[1]
    if _fused(names, int(i)):
        if w == "w2":
            return Source([f"model.layers.{i}.mlp.experts.down_proj"])
        return Source([f"model.layers.{i}.mlp.experts.gate_up_proj"], 0 if w == "w1" else 1)
    return Source([f"model.layers.{i}.mlp.experts.{e}.{_EXPERT[w]}.weight" for e in range(args.n_experts)])
