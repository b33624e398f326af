"""Data parallelism — DDP, ZeRO-2, FSDP, HSDP — each one function on a model and its data-parallel mesh
(parallel/parallelize.py picks the mesh and fixes the order), plus gathering helpers for sharded models. ZeRO-1
shards only the optimizer's state, so it is built with the optimizer (optim.build_zero1_optimizer)."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from scaletrain.models.moe import MoE
from scaletrain.parallel.comm import set_prefetch

log = logging.getLogger(__name__)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, *, device: torch.device, bucket_mb: int) -> nn.Module:
    """Wrap in DDP (Li et al. 2020): bucketed gradient all-reduce overlapped with backward. `device`: this rank's
    (resolved once by init_distributed), the one DDP's device_ids names on CUDA.

    Buffers are not re-broadcast before every forward: the only buffer (the RoPE table) is computed identically on
    every rank (DDP still copies rank 0's once at construction, like the parameters: the same values anyway).
    """
    device_ids = [device.index] if device.type == "cuda" else None
    wrapped = DDP(
        model,
        process_group=dp_mesh.get_group(),
        device_ids=device_ids,
        bucket_cap_mb=bucket_mb,
        forward_sync_buffers=False,
        gradient_as_bucket_view=True,
    )
    log.info("applied DDP over %d ranks, %d MiB buckets", dp_mesh.size(), bucket_mb)
    return wrapped


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool | int,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    prefetch: int = 0,
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """FSDP2 `fully_shard`: one unit per transformer block plus the root (embedding, final norm, output), so one
    block's parameters are gathered at a time. Parameters, gradients and optimizer state are sharded (ZeRO-3).

    reshard_after_forward=False keeps each block's gathered parameters from its forward until its backward: no
    second all-gather, at the memory cost of a whole unsharded model — ZeRO-2. An int N keeps them sharded over N
    ranks in between (FSDP2's reshard to a smaller mesh). A 2-D mesh (replicate, shard) gives HSDP: sharded inside
    a group, gradients all-reduced across groups. prefetch: parallel.fsdp_prefetch (comm.set_prefetch).

    expert_mesh (expert parallel: the dp_mod_ep ranks that hold the same experts): each MoE block's experts become
    their own unit over it, inside their block's unit (which then leaves them out). Their gradients are divided by
    the dense mesh's size, not theirs: each expert shard's gradient already sums its ep peers' tokens (the
    all-to-all's backward), so summing over dp_mod_ep gives the whole data-parallel sum, as for dense weights."""
    # CPUOffloadPolicy (memory.optimizer_offload) keeps parameters, gradients and AdamW state on the host.
    kw = {
        "mesh": mesh,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": offload_policy or OffloadPolicy(),
    }
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's backward runs right after the forward: resharding it would only re-gather it.
        last = i == len(blocks) - 1
        reshard = False if last else reshard_after_forward
        if expert_mesh is not None and isinstance(block.feed_forward, MoE):
            # An int (reshard to N ranks) is a size of the dense mesh; the experts' smaller mesh just reshards.
            experts = fully_shard(block.feed_forward.experts, **{**kw, "mesh": expert_mesh},
                                  reshard_after_forward=reshard if isinstance(reshard, bool) else True)  # fmt: skip
            experts.set_gradient_divide_factor(float(mesh.size()))
            # A factor other than the group size would reduce with PREMUL_SUM, which gloo lacks: sum, then
            # divide (one path on CPU and GPU). Not on one rank (ep = dp_shard), where FSDP2 (torch 2.13)
            # sends nothing and divides its copy by the factor, and forcing the sum would divide a second time.
            experts.set_force_sum_reduction_for_comms(expert_mesh.size() > 1)
        fully_shard(block, reshard_after_forward=reshard, **kw)
    # FSDP keeps the root's parameters gathered after forward whatever the flag (backward needs them at once).
    fully_shard(model, reshard_after_forward=bool(reshard_after_forward), **kw)
    set_prefetch(blocks, prefetch)
    kind = "HSDP" if mesh.ndim == 2 else ("FSDP (ZeRO-3)" if reshard_after_forward else "ZeRO-2 (FSDP2)")
    if not isinstance(reshard_after_forward, bool):
        kind += f", resharded to {reshard_after_forward} ranks after forward"
    log.info(
        "applied %s over mesh %s, %d block units + root",
        kind,
        dict(zip(mesh.mesh_dim_names, mesh.shape)),
        len(blocks),
    )
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, on CPU, on every rank, under the unwrapped model's names (DDP's "module." prefix
    dropped, TP/FSDP shards gathered). A collective: call it on all ranks. Not `cpu_offload=True`: with a full state
    dict that option leaves every rank but 0 with an empty dict."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in sd.items()}
