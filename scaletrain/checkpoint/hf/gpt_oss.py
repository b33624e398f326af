"""The GPT-OSS state-dict adapter (GptOssForCausalLM): Llama's names (llama.py) for the embedding, norms and
attention projections, plus their biases, the per-head `self_attn.sinks`, the biased `mlp.router`, and the experts
as transformers keeps them in memory and on disk (no Hub-layout conversion exists for GPT-OSS):
`mlp.experts.gate_up_proj` [E, D, 2H] with gate and up in alternate columns (gate at even), its bias [E, 2H],
`mlp.experts.down_proj` [E, H, D] and its bias [E, D]: x @ W, the transpose of our nn.Linear-style [E, H, D].

The published checkpoints are refused: their experts are MXFP4-quantised (`*_blocks`, `*_scales`) and their RoPE
is YaRN-scaled, neither of which our model computes; a bf16/fp32 GPT-OSS saved by transformers imports."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from scaletrain.checkpoint.hf import llama
from scaletrain.checkpoint.hf.files import Source
from scaletrain.models.llama import YARN_BETA_FAST, YARN_BETA_SLOW, ModelArgs, layer_window
from scaletrain.models.moe import GPT_OSS_ALPHA

NAME = "GPT-OSS"
MODEL_TYPES = ("gpt_oss",)
ARCHITECTURE = "GptOssForCausalLM"
DEFAULT_ROPE_THETA = 150000.0  # GptOssConfig.default_theta

_OURS = re.compile(
    r"layers\.(?P<i>\d+)\.(?P<rest>attention\.sinks\.weight|feed_forward\.(router\.gate\.(weight|bias)|"
    r"router\.expert_bias|experts\.[wb][123]))"
)
_ATTN_BIAS = re.compile(r"layers\.(?P<i>\d+)\.attention\.(?P<w>w[qkvo])\.bias")
_PROJ = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}


def architecture(args: ModelArgs) -> str:
    return ARCHITECTURE


def _layer_types(args: ModelArgs) -> list[str]:
    return ["sliding_attention" if layer_window(args, i) else "full_attention" for i in range(args.n_layers)]


def _rope(args: ModelArgs) -> dict:
    if args.rope_scaling != "yarn":
        return {"rope_type": "default", "rope_theta": args.rope_theta}
    return {
        "rope_type": "yarn", "rope_theta": args.rope_theta, "factor": args.rope_scaling_factor,
        "original_max_position_embeddings": args.rope_original_max_len, "beta_fast": YARN_BETA_FAST,
        "beta_slow": YARN_BETA_SLOW, "truncate": args.rope_yarn_truncate,
    }  # fmt: skip


def export_config(args: ModelArgs, eod_id: int | None = None) -> dict:
    cfg = llama.config_json(args, eod_id)
    for k in ("mlp_bias", "rope_theta", "hidden_act"):
        del cfg[k]
    return cfg | {
        "architectures": [ARCHITECTURE],
        "model_type": "gpt_oss",
        "intermediate_size": args.moe_hidden or args.ffn_hidden,
        "attention_bias": True,
        "num_local_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "sliding_window": args.window or None,
        "layer_types": _layer_types(args),
        "rope_parameters": _rope(args),
        "swiglu_limit": args.swiglu_limit,
        "swiglu_alpha": GPT_OSS_ALPHA,
        "router_aux_loss_coef": args.aux_loss_coef * args.n_layers / args.top_k,  # see mixtral.aux_coef_to_hf
        "output_router_logits": False,
    }


def import_config(cfg: dict) -> tuple[dict, list[str]]:
    fields, problems = llama.read_config({**cfg, "attention_bias": False})  # biases are ours here
    if not fields:
        return fields, problems
    # No rope_parameters means YaRN in GptOssConfig.
    rope, rope_problems = llama.read_rope(
        {"rope_parameters": {"rope_type": "yarn"}} | cfg, DEFAULT_ROPE_THETA, yarn=True
    )
    n_layers, top_k = fields["n_layers"], int(cfg.get("num_experts_per_tok", 4))
    window = int(cfg.get("sliding_window") or 0)
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)
    ]
    fields |= rope | {
        "family": "gpt_oss",
        "head_size": int(cfg.get("head_dim") or 64),
        "attention_bias": True,
        "attention_sinks": True,
        "moe_bias": True,
        "swiglu_limit": float(cfg.get("swiglu_limit", 7.0)),
        "n_experts": int(cfg.get("num_local_experts", 128)),
        "top_k": top_k,
        "moe_hidden": int(cfg.get("intermediate_size", 2880)),
        "shared_experts": 0,
        "router": "softmax",
        "norm_topk": True,  # a softmax over the top k logits is the top k of the softmax, renormalised
        "moe_every": 1,
        "first_dense": 0,
        "capacity_factor": 0.0,
        "aux_loss_coef": float(cfg.get("router_aux_loss_coef", 0.001)) * top_k / n_layers,
        "window": window if "sliding_attention" in types else 0,
        "window_every": 2 if "full_attention" in types else 1,
    }
    if types != [t for t in _layer_types(ModelArgs(**{**fields, "max_seq_len": 1}))]:
        problems.append(
            f"config.json: layer_types {types} is not sliding and full attention alternating from layer 0 (or one "
            "kind throughout), the patterns model.window_every computes"
        )
    if float(cfg.get("swiglu_alpha", GPT_OSS_ALPHA)) != GPT_OSS_ALPHA:
        problems.append(f"config.json: swiglu_alpha {cfg['swiglu_alpha']} is not GPT-OSS's {GPT_OSS_ALPHA}")
    if cfg.get("quantization_config"):
        problems.append(
            "config.json: the weights are quantised (quantization_config, MXFP4 in the published checkpoints); "
            "only bf16 or fp32 GPT-OSS weights import (dequantise with transformers first)"
        )
    return fields, problems + rope_problems


def export_problems(args: ModelArgs, buffers: dict[str, torch.Tensor]) -> list[str]:
    checks = [
        (not (args.attention_bias and args.attention_sinks), "GPT-OSS attention has biases and sinks"),
        (not args.moe_bias, "GPT-OSS's router and experts have biases (moe.bias)"),
        (args.swiglu_limit <= 0, "GPT-OSS's experts clamp their SwiGLU (moe.swiglu_limit > 0)"),
        (args.qk_norm, "GPT-OSS has no QK-norm"),
        (args.n_experts == 0 or args.moe_every != 1 or args.first_dense, "GPT-OSS has an MoE on every block"),
        (args.shared_experts or args.router != "softmax" or not args.norm_topk, "GPT-OSS's router is a softmax "
         "over the top k, no shared experts"),
        (args.capacity_factor > 0, "GPT-OSS is dropless (moe.capacity_factor 0)"),
        (args.window > 0 and args.window_every not in (1, 2), "GPT-OSS alternates window and full attention"),
        (args.tie_embeddings, "GPT-OSS's embedding and output are apart"),
        (args.rope_scaling == "llama3", "GPT-OSS's RoPE is plain or YaRN, not Llama 3.1's scaling"),
    ]  # fmt: skip
    problems = [msg for bad, msg in checks if bad]
    if any(bool(v.ne(0).any()) for v in buffers.values()):
        problems.append("the routing bias (moe.bias_update_rate) is nonzero; GPT-OSS has none")
    return problems


def _gate_up(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """[E, H, D] gate and up to GPT-OSS's [E, D, 2H], alternating columns (gate first)."""
    return torch.stack([w1, w3], dim=2).flatten(1, 2).transpose(1, 2).contiguous()


def export_tensors(
    args: ModelArgs, name: str, value: torch.Tensor, read: Callable[[str], torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    if m := _ATTN_BIAS.fullmatch(name):
        return {f"model.layers.{m['i']}.self_attn.{_PROJ[m['w']]}.bias": value}
    m = _OURS.fullmatch(name)
    if m is None:
        return {llama.to_hf_name(name): value}
    p, rest = f"model.layers.{m['i']}", m["rest"]
    e = args.n_experts
    if rest == "attention.sinks.weight":
        return {f"{p}.self_attn.sinks": value}
    if rest.startswith("feed_forward.router.gate."):
        return {f"{p}.mlp.router.{rest.rsplit('.', 1)[1]}": value}
    leaf = rest.rsplit(".", 1)[1]
    if rest == "feed_forward.router.expert_bias" or leaf in ("w3", "b3"):
        return {}  # no HF tensor; w3 and b3 are written with w1 and b1, in one gate_up tensor each
    if leaf == "w2":
        return {f"{p}.mlp.experts.down_proj": value.transpose(1, 2).contiguous()}
    if leaf == "b2":
        return {f"{p}.mlp.experts.down_proj_bias": value.view(e, -1)}
    up = read(name[:-1] + "3")  # GPT-OSS keeps gate and up in one tensor, alternating columns (gate first)
    if leaf == "w1":
        return {f"{p}.mlp.experts.gate_up_proj": _gate_up(value, up)}
    gate_up = torch.stack([value.view(e, -1), up.view(e, -1)], dim=2).flatten(1, 2)
    return {f"{p}.mlp.experts.gate_up_proj_bias": gate_up}


def import_names(args: ModelArgs, names: set[str]) -> set[str]:
    expected = set(llama.tensor_names(args.n_layers, moe=True))
    for i in range(args.n_layers):
        p = f"model.layers.{i}"
        expected |= {f"{p}.self_attn.{w}.bias" for w in _PROJ.values()} | {f"{p}.self_attn.sinks"}
        expected |= {f"{p}.mlp.router.weight", f"{p}.mlp.router.bias"}
        expected |= {f"{p}.mlp.experts.{n}" for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj")}
        expected |= {f"{p}.mlp.experts.down_proj_bias"}
    return expected


def import_source(args: ModelArgs, name: str, names: set[str]) -> Source:
    if m := _ATTN_BIAS.fullmatch(name):
        return Source([f"model.layers.{m['i']}.self_attn.{_PROJ[m['w']]}.bias"])
    m = _OURS.fullmatch(name)
    if m is None:
        return Source([llama.to_hf_name(name)])
    p, rest = f"model.layers.{m['i']}", m["rest"]
    if rest == "attention.sinks.weight":
        return Source([f"{p}.self_attn.sinks"])
    if rest.startswith("feed_forward.router.gate."):
        return Source([f"{p}.mlp.router.{rest.rsplit('.', 1)[1]}"])
    if rest == "feed_forward.router.expert_bias":
        return Source([])
    leaf = rest.rsplit(".", 1)[1]
    half = 0 if leaf[1] == "1" else 1
    transforms = {
        "w1": (f"{p}.mlp.experts.gate_up_proj", lambda t: t[:, :, half::2].transpose(1, 2)),
        "w3": (f"{p}.mlp.experts.gate_up_proj", lambda t: t[:, :, half::2].transpose(1, 2)),
        "w2": (f"{p}.mlp.experts.down_proj", lambda t: t.transpose(1, 2)),
        "b1": (f"{p}.mlp.experts.gate_up_proj_bias", lambda t: t[:, half::2].flatten()),
        "b3": (f"{p}.mlp.experts.gate_up_proj_bias", lambda t: t[:, half::2].flatten()),
        "b2": (f"{p}.mlp.experts.down_proj_bias", lambda t: t.flatten()),
    }
    hf, transform = transforms[leaf]
    return Source([hf], transform=transform, rows=leaf.startswith("w"))  # the biases are flat: read whole
