"""What mixture-of-experts layers change in the planner's memory and time models, as per-layer averages over the
model's blocks (MoE blocks are every moe_every-th after first_dense; the rest are dense): the routed experts'
parameters (split over ep ranks, not over tp), the FFN width a token's compute sees (top_k + shared experts, not
all of them), and the tokens each MoE layer sends through expert-parallel all-to-alls."""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.models.llama import ModelArgs
from scaletrain.models.moe import is_moe_layer


@dataclass(frozen=True)
class FFNShape:
    """Per-layer averages over the model's blocks (all zero routed parts for a dense model)."""

    moe_share: float  # fraction of blocks that are MoE
    dense: (
        float  # parameters of every expert a token always passes (dense SwiGLU or shared experts) and router
    )
    routed: float  # parameters of the routed experts (sharded over ep)
    active_hidden: (
        float  # SwiGLU hidden width one token's compute sees: dense ffn_hidden, or (top_k + shared) x
    )


def ffn_shape(args: ModelArgs) -> FFNShape:
    n_experts = getattr(args, "n_experts", 0)
    moe = sum(is_moe_layer(args, i) for i in range(args.n_layers)) if n_experts else 0
    share = moe / args.n_layers
    if not moe:
        return FFNShape(0.0, 3 * args.dim * args.ffn_hidden, 0.0, float(args.ffn_hidden))
    hidden = args.moe_hidden or args.ffn_hidden
    swiglu = 3 * args.dim * hidden
    dense = (1 - share) * 3 * args.dim * args.ffn_hidden
    dense += share * (args.shared_experts * swiglu + args.dim * n_experts)
    routed = share * n_experts * swiglu
    active = (1 - share) * args.ffn_hidden + share * (args.top_k + args.shared_experts) * hidden
    return FFNShape(share, dense, routed, active)


def dispatch_bytes(args: ModelArgs, tokens: float, elt: int) -> float:
    """Bytes one rank sends into one MoE layer's dispatch (the combine sends as many back): each token's hidden
    state once per routed expert."""
    return tokens * getattr(args, "top_k", 0) * args.dim * elt
