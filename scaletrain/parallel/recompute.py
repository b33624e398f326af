"""Activation recompute (checkpointing) of transformer blocks: full, every k-th block, or selective (op level).

A recomputed block keeps only its inputs from the forward and runs its forward again inside the backward
(Chen et al. 2016). Selective recompute (Korthikanti et al. 2022) keeps the outputs of the expensive ops — the
matmuls and the fused attention kernel — and recomputes only the cheap element-wise ops and norms, whose outputs
take most of the memory per FLOP. Both use torch.utils.checkpoint (non-reentrant), as torchtitan does.
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


def recomputed_blocks(keys: list[str], mode: str, every: int = 1) -> list[str]:
    """The blocks (keys of `model.layers`, i.e. global layer indices) a policy recomputes. every_k takes the
    k-th, 2k-th, ... layer of the whole model, so a pipeline stage recomputes the same layers as the unsplit model."""
    if mode == "none":
        return []
    if mode == "every_k":
        return [k for k in keys if (int(k) + 1) % every == 0]
    if mode in ("full", "selective"):
        return list(keys)
    raise ValueError(f"unknown recompute mode {mode!r}: choose none, full, every_k or selective")


def checkpoint_forward(block: nn.Module, selective: bool = False) -> None:
    """Run `block`'s forward under torch.utils.checkpoint (with the selective policy, or keeping only its inputs).
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

    block.forward = forward_selective if selective else forward


def apply_recompute(model: nn.Module, mode: str, every: int = 1) -> nn.Module:
    """Recompute the blocks of `model.layers` that `mode` names (none, full, every_k, selective), in place."""
    keys = recomputed_blocks(list(model.layers.keys()), mode, every)
    for k in keys:
        checkpoint_forward(model.layers[k], selective=mode == "selective")
    if mode != "none":
        what = "keeping matmul and attention outputs" if mode == "selective" else "keeping block inputs only"
        log.info(
            "applied %s recompute to %d of %d blocks (%s): %s",
            mode if mode != "every_k" else f"every-{every}",
            len(keys),
            len(model.layers),
            what,
            ", ".join(keys) or "none on this stage",
        )
    return model
