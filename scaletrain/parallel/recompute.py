"""Activation recompute (checkpointing) of transformer blocks: full, every k-th block, or selective (op level).

A recomputed block keeps only its inputs from the forward and runs its forward again inside the backward
(Chen et al. 2016). Selective recompute (Korthikanti et al. 2022) keeps the outputs of the expensive ops — the
matmuls and the fused attention kernel — and recomputes only the cheap element-wise ops and norms, whose outputs
take most of the memory per FLOP. selective_op is torchtitan's per-op policy (its default selective AC): the same,
except that every second Linear matmul of a block's forward is recomputed too. All use torch.utils.checkpoint
(non-reentrant), as torchtitan does.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from scaletrain.parallel.context_parallel import ring_attention_op

log = logging.getLogger(__name__)

_SAVE_NAMES = (
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    # SDPA's fused kernels: their outputs (with the logsumexp) are O(seq), the softmax inside them is never stored.
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    # Sequence parallel's reduce-scatter after wo and w2: recomputing it would repeat the communication.
    "_c10d_functional.reduce_scatter_tensor.default",
)


def _resolve(name: str):
    """The op overload `name` (namespace.op.overload), or None where this torch build lacks it."""
    namespace, op, overload = name.split(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except (AttributeError, RuntimeError):
        return None


# Context parallel's ring attention (one op): re-running it would repeat its attention and its K/V exchange.
SAVED_OPS = frozenset(
    [*(op for op in map(_resolve, _SAVE_NAMES) if op is not None), ring_attention_op._opoverload]
)


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep matmul and attention outputs; recompute everything else (element-wise ops, norms, RoPE, SiLU)."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    return create_selective_checkpoint_contexts(selective_policy)


# The Linear layers' matmuls (addmm where a Linear has a bias) that selective_op counts, in forward order.
LINEAR_OPS = frozenset((torch.ops.aten.mm.default, torch.ops.aten.addmm.default))


def selective_op_context():
    """torchtitan's per-op policy (selective_ac_option = "op"): as selective_policy, but the 2nd, 4th, ... Linear
    matmul of each block's forward is recomputed (in a Llama block wk, wo and w3: 37% of its Linear FLOPs at 8B,
    saving their outputs' memory). The count restarts in each checkpointed forward, and runs apart in its recompute
    for the torch versions that ask the policy again there (torch 2.13 replays the forward's decisions)."""
    counts = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in LINEAR_OPS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return selective_policy(ctx, op, *args, **kwargs)

    return create_selective_checkpoint_contexts(policy)


def recomputed_blocks(keys: list[str], mode: str, every: int = 1) -> list[str]:
    """The blocks (keys of `model.layers`, i.e. global layer indices) a policy recomputes. every_k takes the
    k-th, 2k-th, ... layer of the whole model, so a pipeline stage recomputes the same layers as the unsplit model."""
    if mode == "none":
        return []
    if mode == "every_k":
        return [k for k in keys if (int(k) + 1) % every == 0]
    if mode in ("full", "selective", "selective_op"):
        return list(keys)
    raise ValueError(
        f"unknown recompute mode {mode!r}: choose none, full, every_k, selective or selective_op"
    )


def checkpoint_forward(block: nn.Module, policy: str = "full") -> None:
    """Run `block`'s forward under torch.utils.checkpoint (with a selective `policy`, or keeping only its inputs).
    The forward is replaced on the instance, not wrapped in a new module (checkpoint_wrapper would add
    `_checkpoint_wrapped_module.` to every parameter name), so state dicts and checkpoints are the same under every
    policy, and hooks on the block (FSDP's unshard) stay outside it."""
    inner = block.forward

    # Two functions rather than one with a context_fn argument: torch.compile traces `context_fn` only when it
    # names a function directly (a closure variable of the default noop fails in dynamo, torch 2.13).
    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    @functools.wraps(inner)
    def forward_selective(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, context_fn=selective_context, **kwargs)

    @functools.wraps(inner)
    def forward_selective_op(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, context_fn=selective_op_context, **kwargs)

    forwards = {"selective": forward_selective, "selective_op": forward_selective_op}
    block.forward = forwards.get(policy, forward)


_KEPT = {
    "selective": "keeping matmul and attention outputs",
    "selective_op": "keeping attention outputs and every other matmul's",
}


def apply_recompute(model: nn.Module, mode: str, every: int = 1) -> nn.Module:
    """Recompute the blocks of `model.layers` that `mode` names (none, full, every_k, selective, selective_op), in
    place."""
    keys = recomputed_blocks(list(model.layers.keys()), mode, every)
    for k in keys:
        checkpoint_forward(model.layers[k], mode)
    if mode != "none":
        what = _KEPT.get(mode, "keeping block inputs only")
        log.info(
            "applied %s recompute to %d of %d blocks (%s): %s",
            mode if mode != "every_k" else f"every-{every}",
            len(keys),
            len(model.layers),
            what,
            ", ".join(keys) or "none on this stage",
        )
    return model
