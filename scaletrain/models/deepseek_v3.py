"""DeepSeek-V3 (DeepSeek-AI 2024, arXiv 2412.19437): multi-head latent attention (models/mla.py), fine-grained
routed experts with a shared one, sigmoid scores with group-limited routing and the auxiliary-loss-free bias
(models/moe.py, optim/optimizers.RoutingBias), the first blocks dense, and optionally one multi-token prediction
module (models/mtp.py). All of it is the shared Transformer (models/llama.py) with its feature switches set; this
module holds the shapes and the checks of those switches. HF conversion: checkpoint/hf/deepseek_v3.py."""

from __future__ import annotations

from typing import Protocol

# DeepSeek-V3's published counts: 671B parameters, 37B activated per token (the paper's abstract; its 14B
# multi-token prediction module apart). Checked on the meta device by tests/unit/test_deepseek_v3.py.
PUBLISHED = {"deepseek_v3_671b": (671e9, 37e9)}

_MLA_V3 = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
_ROUTING_V3 = dict(router="sigmoid", n_group=8, topk_group=4, route_scale=2.5)

DEEPSEEK_V3_PRESETS: dict[str, dict] = {
    # The debug model's size with every DeepSeek-V3 feature on: MLA with a query latent, 8 experts of half the
    # dense hidden size in 4 groups (top-2 from the best 2 groups), one shared expert, block 0 dense.
    "debug_deepseek_v3": dict(
        family="deepseek_v3",
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=4,
        ffn_hidden=352,
        vocab_size=None,
        norm_eps=1e-6,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_experts=8,
        top_k=2,
        moe_hidden=176,
        shared_experts=1,
        first_dense=1,
        router="sigmoid",
        n_group=4,
        topk_group=2,
        route_scale=2.5,
    ),
    # config.json of deepseek-ai/DeepSeek-V3 (without its YaRN extension to 128K, a later context stage).
    "deepseek_v3_671b": dict(
        family="deepseek_v3",
        dim=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=128,
        ffn_hidden=18432,
        vocab_size=129280,
        norm_eps=1e-6,
        **_MLA_V3,
        n_experts=256,
        top_k=8,
        moe_hidden=2048,
        shared_experts=1,
        first_dense=3,
        **_ROUTING_V3,
    ),
}


class ModelArgs(Protocol):
    n_heads: int
    n_experts: int
    top_k: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_group: int
    topk_group: int
    route_scale: float
    mtp_depth: int
    mtp_loss_coef: float
    window: int


def deepseek_problems(args: ModelArgs) -> list[str]:
    """The MLA and group-limited routing fields as resolved, each with the field to change."""
    problems = []
    if args.kv_lora_rank < 0 or args.q_lora_rank < 0:
        problems.append("model.kv_lora_rank and model.q_lora_rank must be >= 0 (0: off)")
    if args.kv_lora_rank > 0:
        problems += [
            f"model.{name} must be >= 1 with model.kv_lora_rank > 0 (MLA), got {getattr(args, name)}"
            for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
            if getattr(args, name) < 1
        ]
        if args.qk_rope_head_dim % 2:
            problems.append(f"model.qk_rope_head_dim {args.qk_rope_head_dim} is odd; RoPE rotates pairs")
    if args.mtp_depth not in (0, 1):
        problems.append(f"model.mtp_depth must be 0 or 1 (one MTP module), got {args.mtp_depth}")
    if args.mtp_depth and args.mtp_loss_coef < 0:
        problems.append(f"model.mtp_loss_coef must be >= 0, got {args.mtp_loss_coef}")
    if args.mtp_depth and args.window > 0:
        problems.append(
            "model.mtp_depth with model.window is refused: the MTP block attends causally, unwindowed"
        )
    if args.route_scale <= 0:
        problems.append(f"moe.route_scale must be > 0, got {args.route_scale}")
    g, e = args.n_group, args.n_experts
    if g < 1 or not 1 <= args.topk_group <= max(g, 1):
        problems.append(f"moe.n_group {g} must be >= 1 and moe.topk_group {args.topk_group} in 1..n_group")
    elif g > 1 and e > 0:
        if e % g or e // g < 2:
            problems.append(
                f"moe.n_group {g} must divide moe.n_experts {e} into groups of at least 2 (a group scores the "
                "sum of its two best experts)"
            )
        elif args.top_k > args.topk_group * (e // g):
            problems.append(
                f"moe.top_k {args.top_k} exceeds the {args.topk_group * (e // g)} experts of moe.topk_group "
                f"{args.topk_group} groups; raise moe.topk_group or lower moe.top_k"
            )
    return problems
