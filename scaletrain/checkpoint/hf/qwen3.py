"""The Qwen3 state-dict adapter (Qwen3ForCausalLM, and with MoE blocks Qwen3MoeForCausalLM): a Llama (llama.py
maps the shared names) with QK-norm (`self_attn.q_norm`/`k_norm`, one RMSNorm of head_dim channels each), an
explicit head_dim, and for the MoE a softmax router over `mlp.experts` without shared experts.

Expert names on disk: the Hub checkpoints keep one 2-D tensor per expert (`mlp.experts.{e}.gate_proj/up_proj/
down_proj.weight`, `mlp.gate.weight`), which save_pretrained also writes; transformers >= 5 fuses them in memory
(`mlp.experts.gate_up_proj` [E, 2H, D] = gate then up, `mlp.experts.down_proj` [E, D, H]). We write the Hub
layout and read both, as for Mixtral."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from scaletrain.checkpoint.hf import llama
from scaletrain.checkpoint.hf.files import Source
from scaletrain.models.moe import is_moe_layer

if TYPE_CHECKING:
    from scaletrain.models.llama import ModelArgs

NAME = "Qwen3"
MODEL_TYPES = ("qwen3", "qwen3_moe")
DENSE, MOE = "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"
DEFAULT_ROPE_THETA = 10000.0  # Qwen3Config's when config.json names none (the published models set 1e6)

_HF_EXPERT = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_OURS = re.compile(
    r"layers\.(?P<i>\d+)\.feed_forward\.(?P<leaf>router\.gate\.weight|router\.expert_bias|experts\.w[123])"
)
_NORMS = re.compile(r"layers\.(?P<i>\d+)\.attention\.(?P<n>[qk])_norm\.weight")


def architecture(args: ModelArgs) -> str:
    return MOE if args.n_experts > 0 else DENSE


def export_config(args: ModelArgs, eod_id: int | None = None) -> dict:
    cfg = llama.config_json(args, eod_id)
    del cfg["mlp_bias"]  # not a Qwen3 field
    cfg |= {"architectures": [architecture(args)], "model_type": "qwen3", "use_sliding_window": False}
    if args.n_experts > 0:
        cfg |= {
            "model_type": "qwen3_moe",
            "num_experts": args.n_experts,
            "num_experts_per_tok": args.top_k,
            "moe_intermediate_size": args.moe_hidden or args.ffn_hidden,
            "norm_topk_prob": args.norm_topk,
            "decoder_sparse_step": args.moe_every,
            "mlp_only_layers": list(range(args.first_dense)),
            "router_aux_loss_coef": args.aux_loss_coef
            * args.n_layers
            / args.top_k,  # see mixtral.aux_coef_to_hf
            "output_router_logits": False,
        }
    return cfg


def import_config(cfg: dict) -> tuple[dict, list[str]]:
    fields, problems = llama.read_config(cfg)
    if not fields:
        return fields, problems
    rope, rope_problems = llama.read_rope(cfg, DEFAULT_ROPE_THETA)
    fields |= rope | {"family": "qwen3", "qk_norm": True, "head_size": int(cfg.get("head_dim") or 128)}
    if cfg.get("use_sliding_window"):
        problems.append("config.json: use_sliding_window is true; only Qwen3 with full attention imports")
    if cfg.get("model_type") == "qwen3_moe":
        moe, moe_problems = _read_moe(cfg)
        fields |= moe
        problems += moe_problems
    return fields, problems + rope_problems


def _read_moe(cfg: dict) -> tuple[dict, list[str]]:
    n_layers, top_k = int(cfg["num_hidden_layers"]), int(cfg.get("num_experts_per_tok", 8))
    dense = sorted(int(i) for i in cfg.get("mlp_only_layers") or [])
    fields = {
        "n_experts": int(cfg.get("num_experts", cfg.get("num_local_experts", 128))),  # attribute_map alias
        "top_k": top_k,
        "moe_hidden": int(cfg.get("moe_intermediate_size", 768)),
        "shared_experts": 0,
        "router": "softmax",
        "norm_topk": bool(cfg.get("norm_topk_prob", False)),
        "moe_every": int(cfg.get("decoder_sparse_step", 1)),
        "first_dense": len(dense),
        "capacity_factor": 0.0,
        "aux_loss_coef": float(cfg.get("router_aux_loss_coef", 0.001)) * top_k / n_layers,
    }
    problems = []
    if dense != list(range(len(dense))):
        problems.append(
            f"config.json: mlp_only_layers {dense} are not the first blocks; our model keeps only a prefix of "
            "blocks dense (moe.first_dense)"
        )
    return fields, problems


def export_problems(args: ModelArgs, buffers: dict[str, torch.Tensor]) -> list[str]:
    arch = architecture(args)
    checks = [
        (not args.qk_norm, f"model.qk_norm is false; {arch} normalises every head's q and k"),
        (args.window > 0, f"model.window is {args.window}; export Qwen3 with full attention"),
        (
            args.rope_scaling != "none",
            f"model.rope_scaling is {args.rope_scaling!r}; this export writes plain RoPE",
        ),
        (args.shared_experts != 0, f"moe.shared_experts is {args.shared_experts}; {arch} has none"),
        (
            args.n_experts > 0 and args.router != "softmax",
            f"moe.router is {args.router!r}; {arch} routes by softmax",
        ),
        (args.capacity_factor > 0, f"moe.capacity_factor is {args.capacity_factor}; {arch} is dropless"),
    ]
    problems = [msg for bad, msg in checks if bad]
    biased = [k for k, v in buffers.items() if bool(v.ne(0).any())]
    if biased:
        problems.append(
            f"the routing bias (moe.bias_update_rate) is nonzero in {len(biased)} layer(s); {arch} has none"
        )
    return problems


def export_tensors(
    args: ModelArgs, name: str, value: torch.Tensor, read: object = None
) -> dict[str, torch.Tensor]:
    if args.tie_embeddings and name == "output.weight":
        return {}
    if m := _NORMS.fullmatch(name):
        return {f"model.layers.{m['i']}.self_attn.{m['n']}_norm.weight": value}
    m = _OURS.fullmatch(name)
    if m is None:
        return {llama.to_hf_name(name): value}
    prefix, leaf = f"model.layers.{m['i']}.mlp", m["leaf"]
    if leaf == "router.gate.weight":
        return {f"{prefix}.gate.weight": value}
    if leaf == "router.expert_bias":
        return {}
    w = _HF_EXPERT[leaf.split(".")[1]]
    return {f"{prefix}.experts.{e}.{w}.weight": value[e].contiguous() for e in range(value.shape[0])}


def _fused(names: set[str], i: int) -> bool:
    return f"model.layers.{i}.mlp.experts.gate_up_proj" in names


def import_names(args: ModelArgs, names: set[str]) -> set[str]:
    expected = set(llama.tensor_names(args.n_layers))
    for i in range(args.n_layers):
        expected |= {f"model.layers.{i}.self_attn.{n}_norm.weight" for n in "qk"}
        if not is_moe_layer(args, i):
            continue
        p = f"model.layers.{i}.mlp"
        expected -= {f"{p}.{w}.weight" for w in _HF_EXPERT.values()}
        if _fused(names, i):
            expected |= {f"{p}.gate.weight", f"{p}.experts.gate_up_proj", f"{p}.experts.down_proj"}
        else:
            experts = range(args.n_experts)
            expected |= {f"{p}.gate.weight"} | {
                f"{p}.experts.{e}.{w}.weight" for e in experts for w in _HF_EXPERT.values()
            }
    return expected


def import_source(args: ModelArgs, name: str, names: set[str]) -> Source:
    if name == "output.weight" and args.tie_embeddings:
        return Source(["model.embed_tokens.weight"])
    if m := _NORMS.fullmatch(name):
        return Source([f"model.layers.{m['i']}.self_attn.{m['n']}_norm.weight"])
    m = _OURS.fullmatch(name)
    if m is None:
        return Source([llama.to_hf_name(name)])
    i, leaf = int(m["i"]), m["leaf"]
    p = f"model.layers.{i}.mlp"
    if leaf == "router.expert_bias":
        return Source([])
    if leaf == "router.gate.weight":
        return Source([f"{p}.gate.weight"])
    w = leaf.split(".")[1]
    if not _fused(names, i):
        return Source([f"{p}.experts.{e}.{_HF_EXPERT[w]}.weight" for e in range(args.n_experts)])
    if w == "w2":
        return Source([f"{p}.experts.down_proj"])
    return Source([f"{p}.experts.gate_up_proj"], chunk=0 if w == "w1" else 1)
