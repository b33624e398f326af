"""Tensor parallel (Megatron-LM, Shoeybi et al. 2019) and sequence parallel (Korthikanti et al. 2022) as a plan:
a dict from module name to a PyTorch ParallelStyle, applied with `parallelize_module` on the "tp" mesh."""

from __future__ import annotations

import contextlib
import logging
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from scaletrain.models.moe import MoE

log = logging.getLogger(__name__)


class ReplicateParallel(ParallelStyle):
    """Replicated parameters as DTensors on the tp mesh, replicated activations in and out (the norms without
    sequence parallel). Left as plain tensors they would sit beside DTensor parameters, and gradient clipping's
    foreach norm, FSDP's 2-D sharding and DCP all want every parameter of a model on the same mesh."""

    @staticmethod
    def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for p_name, p in list(module.named_parameters(recurse=False)):
            # Every rank holds the same values (the model is materialised identically everywhere): no broadcast.
            module.register_parameter(
                p_name, nn.Parameter(DTensor.from_local(p.data, mesh, [Replicate()], run_check=False))
            )

    @staticmethod
    def _input_fn(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        x = (
            x.redistribute(mesh, [Replicate()])
            if isinstance(x, DTensor)
            else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        )
        return (x, *inputs[1:])

    @staticmethod
    def _output_fn(mod: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        return out.to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._replicate_params, self._input_fn, self._output_fn)


class HeadShard(ParallelStyle):
    """A module's parameters split on dim 0 over the tp mesh, for one value per attention head (GPT-OSS's sinks):
    rank r holds the heads ColwiseParallel gives it in wq. The module is read, not called (HeadSinks.local)."""

    @staticmethod
    def _shard(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for p_name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(p_name, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)])))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._shard)


def tp_plan(model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """The Megatron split, as torchtitan's llama plan: q/k/v and w1/w3 by output columns (each rank owns whole
    heads and a slice of the MLP hidden size), wo and w2 by input rows, so each block needs one all-reduce forward
    and one backward. The embedding and output are split by vocabulary.

    With sequence parallel the residual stream stays a DTensor sharded on the sequence (Shard(1)): the norms run on
    1/tp of the tokens, the all-reduces become reduce-scatter + all-gather, and `h.shape[1]` in the model is still
    the full length, so its RoPE table slice is right. cos/sin reach each block as extra positional args: they are
    plain replicated tensors, so the input plans mark them `None` (left alone)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    # Under SP, hand DTensors between modules (see above); without it, plain local tensors.
    local = not sequence_parallel
    norm_style = partial(SequenceParallel) if sequence_parallel else ReplicateParallel
    plan: dict[str, ParallelStyle] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        # Rowwise on an embedding splits the vocabulary rows; each rank looks up its ids, masks the others and the
        # partial sums are reduced (or reduce-scattered onto the sequence under SP).
        plan["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=seq, use_local_output=local
        )
    for name in model.layers:
        p = f"layers.{name}."
        plan[p + "attention_norm"] = norm_style()
        if sequence_parallel:
            # All-gather the normed sequence before attention (it needs every position); cos/sin untouched.
            plan[p + "attention"] = PrepareModuleInput(
                input_layouts=(seq, None, None),
                desired_input_layouts=(Replicate(), None, None),
                use_local_output=True,
            )
        for w in ("wq", "wk", "wv"):
            plan[p + f"attention.{w}"] = ColwiseParallel()
        attention = model.layers[name].attention
        if getattr(attention, "q_norm", None) is not None:
            # QK-norm (Qwen3) runs on this rank's heads, [batch, seq, heads, head_dim] split on dim 2: its weight
            # replicated, its gradient summed over the ranks' heads (torchtitan's Qwen3 plan).
            for n in ("q_norm", "k_norm"):
                plan[p + f"attention.{n}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        if getattr(attention, "sinks", None) is not None:
            plan[p + "attention.sinks"] = HeadShard()  # GPT-OSS's sinks: one per head, split as the heads
        plan[p + "attention.wo"] = RowwiseParallel(output_layouts=seq, use_local_output=local)
        plan[p + "ffn_norm"] = norm_style()
        if isinstance(model.layers[name].feed_forward, MoE):
            # MoE blocks are replicated over tp (ep splits the experts): every tp rank routes and computes the
            # same tokens with the same plain weights, so their gradients agree without any reduction. Under SP
            # the normed sequence is gathered in and the output split back onto the sequence.
            if sequence_parallel:
                plan[p + "feed_forward"] = PrepareModuleInputOutput(
                    input_layouts=(seq,),
                    desired_input_layouts=(Replicate(),),
                    use_local_input=True,
                    output_layouts=(Replicate(),),
                    desired_output_layouts=(seq,),
                    use_local_output=False,
                )
            continue
        if sequence_parallel:
            plan[p + "feed_forward"] = PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True
            )
        plan[p + "feed_forward.w1"] = ColwiseParallel()
        plan[p + "feed_forward.w3"] = ColwiseParallel()
        plan[p + "feed_forward.w2"] = RowwiseParallel(output_layouts=seq, use_local_output=local)
    if getattr(model, "norm", None) is not None:
        plan["norm"] = norm_style()
    if getattr(model, "output", None) is not None:
        # Loss parallel keeps the logits sharded by vocabulary (a DTensor) so that cross-entropy never gathers the
        # [tokens, vocab] matrix; otherwise they are gathered into a plain replicated tensor.
        plan["output"] = ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def apply_tp(
    model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool
) -> nn.Module:
    """Shard the model's existing weights over `tp_mesh` in place (call before FSDP)."""
    if (
        getattr(model.args, "tie_embeddings", False)
        and model.output is not None
        and model.tok_embeddings is not None
    ):
        # One tensor cannot be both row-split (embedding) and column-split (output) by vocabulary.
        raise ValueError("tensor parallel does not support tied embeddings; set model.tie_embeddings = false")
    parallelize_module(
        model, tp_mesh, tp_plan(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    )
    if sequence_parallel:
        _local_stage_boundaries(model, tp_mesh)
    log.info(
        "applied tensor parallel over %d ranks%s%s",
        tp_mesh.size(),
        ", sequence parallel" if sequence_parallel else "",
        ", loss parallel" if loss_parallel else "",
    )
    return model


def split_embedding_grad(model: nn.Module) -> None:
    """Keep the vocabulary-split embedding's gradient split as its weight is. torch's DTensor (2.13) computes it
    replicated, the whole table on every tp rank (embedding_dense_backward's sharding), which FSDP2 redistributes
    to the parameter's placement but nothing else would: it stayed whole through the optimizer step, tp - 1 tables
    more than the split (2 GiB at tp 8 on an 8B model; issue 35). Redistributed as soon as it is accumulated (each
    rank keeps its rows: a local copy, no communication), so only the backward's transient is whole. Call where
    FSDP is not applied: under FSDP the parameter is replaced and the hook would never run."""
    emb = getattr(model, "tok_embeddings", None)
    if emb is None or not isinstance(emb.weight, DTensor):
        return

    def split(param: torch.Tensor) -> None:
        grad = param.grad
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            local = grad.redistribute(param.device_mesh, param.placements).to_local()
            if local.untyped_storage().data_ptr() == grad.to_local().untyped_storage().data_ptr():
                # A view would keep the whole table alive. torch 2.13's Replicate -> Shard(0) already copies:
                # cloning that again held a third table shard at the embedding's backward (issue 35, case 15).
                local = local.clone()
            param.grad = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)

    emb.weight.register_post_accumulate_grad_hook(split)


def _local_stage_boundaries(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """A pipeline stage under sequence parallel hands on its tp rank's shard of the sequence as a plain tensor
    (the pipeline moves plain tensors, and each tp rank sends 1/tp of the activation to its peer of the next stage)
    and turns the shard it receives back into the sequence-sharded DTensor its blocks expect. A whole model (with
    the embedding and the output) has no such boundary."""
    if getattr(model, "tok_embeddings", None) is None:
        model.register_forward_pre_hook(
            lambda mod, args: (DTensor.from_local(args[0], tp_mesh, [Shard(1)], run_check=False), *args[1:])
        )
    if getattr(model, "output", None) is None:
        model.register_forward_hook(
            lambda mod, args, out: out.to_local() if isinstance(out, DTensor) else out
        )


def loss_context(tp_enabled: bool) -> contextlib.AbstractContextManager:
    """Wrap the cross-entropy AND its backward in this: under TP the logits are vocabulary-sharded DTensors and
    `loss_parallel()` computes the softmax with two small all-reduces instead of gathering them."""
    return loss_parallel() if tp_enabled else contextlib.nullcontext()
