"""The Mixtral state-dict adapter: the mixture-of-experts half of a Mixtral (llama.py maps the attention, norm
and embedding names; files.py the files). A Mixtral block is our Llama block with `feed_forward` an MoE:
softmax router, top-k weights renormalised, no shared experts, dropless, and on every layer.

Names on disk: every Hub checkpoint, and what `save_pretrained` writes by default, keep one 2-D tensor per expert
(`block_sparse_moe.experts.{e}.w1/w2/w3.weight`, `block_sparse_moe.gate.weight`). transformers >= 5 fuses them
in memory (`mlp.experts.gate_up_proj` [E, 2H, D] = w1 then w3, `mlp.experts.down_proj` [E, D, H]) and converts
on load; `save_pretrained(save_original_format=False)` writes that layout. We write the Hub layout and read both.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

import torch

from scaletrain.config import MoEConfig
from scaletrain.models.moe import MOE_FIELDS as _TO_ARGS

if TYPE_CHECKING:
    from scaletrain.models.llama import ModelArgs

ARCHITECTURE = "MixtralForCausalLM"
# MixtralConfig's RoPE base when config.json names none (transformers' default_theta for Mixtral).
DEFAULT_ROPE_THETA = 1e6
# ModelArgs field -> its [moe] config field (the inverse of resolve_model_args' mapping); the rest of ModelArgs
# comes from [model]. (Names of [moe]'s training-only fields are in it too; no ModelArgs field has them.)
MOE_FIELDS = {_TO_ARGS.get(f.name, f.name): f.name for f in dataclasses.fields(MoEConfig)}
_HUB = "block_sparse_moe"
_OURS = re.compile(
    r"layers\.(?P<i>\d+)\.feed_forward\.(?P<leaf>router\.gate\.weight|router\.expert_bias|experts\.w[123])"
)
_EXPERT = re.compile(
    r"model\.layers\.(?P<i>\d+)\.block_sparse_moe\.experts\.(?P<e>\d+)\.(?P<w>w[123])\.weight"
)


def is_mixtral(cfg: dict) -> bool:
    return cfg.get("model_type") == "mixtral"


# -- export ---------------------------------------------------------------------------------------------------------


def export_problems(args: ModelArgs, state: dict[str, torch.Tensor]) -> list[str]:
    """Every field of an MoE model that MixtralForCausalLM cannot represent, so an export would load as another
    model: each says which field and why."""
    mx = ARCHITECTURE
    checks = [
        (
            args.shared_experts != 0,
            f"moe.shared_experts is {args.shared_experts}; {mx} has no shared experts",
        ),
        (
            args.router != "softmax",
            f"moe.router is {args.router!r}; {mx} routes by a softmax over the experts",
        ),
        (not args.norm_topk, f"moe.norm_topk is false; {mx} always divides the top-k weights by their sum"),
        (args.moe_every != 1, f"moe.every is {args.moe_every}; {mx} has an MoE feed-forward on every layer"),
        (args.first_dense != 0, f"moe.first_dense is {args.first_dense}; {mx} has no dense layers"),
        (
            args.capacity_factor > 0,
            f"moe.capacity_factor is {args.capacity_factor}; {mx} is dropless, so tokens this model drops would "
            "reach their experts there (set moe.capacity_factor = 0 and train on, or export another run)",
        ),
        (
            args.window > 0 and args.window_every != 1,
            f"model.window_every is {args.window_every}; {mx}'s sliding_window applies to every layer",
        ),
    ]
    problems = [msg for bad, msg in checks if bad]
    biased = [k for k, v in state.items() if k.endswith("router.expert_bias") and bool(v.ne(0).any())]
    if biased:
        layers = ", ".join(_OURS.fullmatch(k)["i"] for k in biased)
        problems.append(
            f"the routing bias (moe.bias_update_rate balancing) is nonzero in layer(s) {layers}; {mx} selects "
            "experts by the router scores alone, so tokens would reach other experts"
        )
    return problems


def config_json(args: ModelArgs) -> dict:
    """The Mixtral entries of config.json, over the Llama ones (hf.hf_config)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "mixtral",
        "intermediate_size": args.moe_hidden or args.ffn_hidden,
        "num_local_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "sliding_window": args.window or None,
        "router_aux_loss_coef": aux_coef_to_hf(args.aux_loss_coef, args.top_k, args.n_layers),
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
    }


def aux_coef_from_hf(coef: float, top_k: int, n_layers: int) -> float:
    """Our moe.aux_loss_coef for the same balance-loss weight as Mixtral's router_aux_loss_coef. HF's loss is
    E sum_e (count_e / T) P_e over all layers' tokens at once (load_balancing_loss_func): top_k times our per-layer
    sum_e f_e P_e (f_e divides by top_k), and counted once where ours is added for every layer."""
    return coef * top_k / n_layers


def aux_coef_to_hf(coef: float, top_k: int, n_layers: int) -> float:
    return coef * n_layers / top_k


def to_hf_tensors(name: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """The Hub-layout tensors of one of our MoE state-dict entries (the routing bias has none: export_problems
    refuses it unless zero); None for a name outside the MoE feed-forward."""
    m = _OURS.fullmatch(name)
    if m is None:
        return None
    prefix = f"model.layers.{m['i']}.{_HUB}"
    leaf = m["leaf"]
    if leaf == "router.gate.weight":
        return {f"{prefix}.gate.weight": value}
    if leaf == "router.expert_bias":
        return {}
    w = leaf.split(".")[1]
    return {f"{prefix}.experts.{e}.{w}.weight": value[e].contiguous() for e in range(value.shape[0])}


# -- import ---------------------------------------------------------------------------------------------------------


def read_config(cfg: dict) -> tuple[dict, list[str]]:
    """(ModelArgs fields, problems) of the MoE and sliding-window entries of a Mixtral config.json."""
    missing = [k for k in ("num_local_experts", "num_experts_per_tok") if k not in cfg]
    if missing:
        return {}, [f"config.json lacks {', '.join(missing)}; is it a complete Mixtral config?"]
    top_k, n_layers = int(cfg["num_experts_per_tok"]), int(cfg["num_hidden_layers"])
    fields = {
        "n_experts": int(cfg["num_local_experts"]),
        "top_k": top_k,
        "moe_hidden": int(cfg["intermediate_size"]),
        "shared_experts": 0,
        "router": "softmax",
        "norm_topk": True,
        "moe_every": 1,
        "first_dense": 0,
        "capacity_factor": 0.0,
        # A training choice, not the weights' (MixtralConfig's default when unset).
        "aux_loss_coef": aux_coef_from_hf(float(cfg.get("router_aux_loss_coef", 0.001)), top_k, n_layers),
        # Same rule as ours: query i sees keys i - window < j <= i (transformers' sliding_window_overlay).
        "window": int(cfg.get("sliding_window") or 0),
        "window_every": 1,
    }
    problems = []
    if not 1 <= top_k <= fields["n_experts"]:
        problems.append(
            f"config.json: num_experts_per_tok {top_k} is not between 1 and num_local_experts {fields['n_experts']}"
        )
    return fields, problems


def layer_names(i: int, n_experts: int, fused: bool) -> set[str]:
    """The HF names of layer i's MoE tensors, in the Hub (one per expert) or the fused layout."""
    if fused:
        return {
            f"model.layers.{i}.mlp.{n}" for n in ("gate.weight", "experts.gate_up_proj", "experts.down_proj")
        }
    prefix = f"model.layers.{i}.{_HUB}"
    experts = {f"{prefix}.experts.{e}.{w}.weight" for e in range(n_experts) for w in ("w1", "w2", "w3")}
    return {f"{prefix}.gate.weight"} | experts


def is_fused(names: list[str] | set[str], i: int) -> bool:
    """Layer i of a checkpoint is in transformers' in-memory (fused) layout."""
    return f"model.layers.{i}.mlp.experts.gate_up_proj" in names


def import_source(name: str, names: set[str] | dict, n_experts: int) -> tuple[list[str], int] | None:
    """How our MoE entry `name` is read from a checkpoint holding the HF tensors `names`, without loading any:
    (HF names, chunk). One name per expert: the Hub layout, stacked on a new dim 0. One name and chunk 0 or 1:
    that half, on dim 1, of the fused gate_up_proj (w1 then w3). One name and
    chunk -1: read whole. No names: zeros (the routing bias, which Mixtral has not). None for a name outside the
    MoE feed-forward."""
    m = _OURS.fullmatch(name)
    if m is None:
        return None
    i, leaf = m["i"], m["leaf"]
    fused = is_fused(names, int(i))
    prefix = f"model.layers.{i}.mlp" if fused else f"model.layers.{i}.{_HUB}"
    if leaf == "router.expert_bias":
        return [], -1
    if leaf == "router.gate.weight":
        return [f"{prefix}.gate.weight"], -1
    w = leaf.split(".")[1]
    if not fused:
        return [f"{prefix}.experts.{e}.{w}.weight" for e in range(n_experts)], -1
    if w == "w2":
        return [f"{prefix}.experts.down_proj"], -1
    return [f"{prefix}.experts.gate_up_proj"], 0 if w == "w1" else 1


def experts_beyond(names: list[str], n_experts: int) -> list[str]:
    """The expert tensors among `names` numbered at or beyond n_experts (num_local_experts)."""
    return [n for n in names if (m := _EXPERT.fullmatch(n)) and int(m["e"]) >= n_experts]


def config_sections(fields: dict) -> tuple[dict, dict]:
    """ModelArgs fields split into the [model] and [moe] sections of a config file."""
    model = {k: v for k, v in fields.items() if k not in MOE_FIELDS}
    moe = {MOE_FIELDS[k]: v for k, v in fields.items() if k in MOE_FIELDS}
    return model, moe
