"""Expert parallel (GShard, Lepikhin et al. 2020): each MoE block's experts are split over the ep ranks, and every
token-expert row travels by all-to-all to the rank holding its expert and back. Applied from outside the model:
`apply_ep` shards `feed_forward.experts` and wraps its forward; the model code stays free of torch.distributed."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor

from scaletrain.models.moe import MoE

log = logging.getLogger(__name__)


def moe_blocks(model: nn.Module) -> list[MoE]:
    """The MoE feed-forwards of a model or pipeline stage (a stage may hold none)."""
    layers = getattr(model, "layers", None) or {}
    return [b.feed_forward for b in layers.values() if isinstance(b.feed_forward, MoE)]


class _Dispatch:
    """The all-to-all of one experts module: tokens to their experts' ranks before its forward, back after.

    Rows arrive grouped by global expert, with counts over all E experts. Rank r holds experts [r L, (r+1) L),
    L = E / ep, so the rows for rank r are one contiguous block: the all-to-all needs no reordering on the way
    out. What arrives is ordered by source rank, then by local expert; the local experts want their rows
    together, so they are regrouped (by local expert, then source rank) and put back before the return trip.
    The state between the two hooks is one forward's: the hooks run back to back around the experts' forward
    (also when activation recompute runs it again)."""

    def __init__(self) -> None:
        self.state: tuple | None = None

    def before(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x, counts = inputs
        ep = mesh.size()
        group = mesh.get_group()
        # received[r, l]: rows that source rank r sends for my local expert l.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts.contiguous(), group=group)
        send_splits = counts.view(ep, -1).sum(1).tolist()
        received = received.view(ep, -1)
        recv_splits = received.sum(1).tolist()
        rows = funcol.all_to_all_single_autograd(x.contiguous(), recv_splits, send_splits, group)
        order = _by_local_expert(received)
        self.state = (order, send_splits, recv_splits)
        return rows[order], received.sum(0)

    def after(self, module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        assert self.state is not None, "the experts' forward ran without its dispatch"
        order, send_splits, recv_splits = self.state
        self.state = None
        # Undo the regrouping (scatter through the inverse permutation), then send each row home.
        back = out[torch.argsort(order)]
        home = funcol.all_to_all_single_autograd(back, send_splits, recv_splits, mesh.get_group())
        return funcol.wait_tensor(home) if isinstance(home, funcol.AsyncCollectiveTensor) else home


def _by_local_expert(received: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder the received rows (source-rank major, [ep, L] counts) to local-expert major."""
    ep, n_local = received.shape
    # Block (r, l) arrives r-th among the sources for expert l: its new key l * ep + r, one key per row.
    keys = (
        torch.arange(n_local, device=received.device) * ep + torch.arange(ep, device=received.device)[:, None]
    )
    return torch.argsort(keys.reshape(-1).repeat_interleave(received.reshape(-1)), stable=True)


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """Shard every MoE block's experts on the expert dim over `ep_mesh` (DTensor Shard(0): rank r holds experts
    [r E/ep, (r+1) E/ep)) and route their rows there by all-to-all. The router, shared experts and the rest of
    the block stay replicated over ep: they are data parallel like any dense weight."""
    blocks = moe_blocks(model)
    for moe in blocks:
        dispatch = _Dispatch()

        def shard(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
            for pname, p in list(module.named_parameters(recurse=False)):
                # src_data_rank=None: every rank holds the same full weights already; take the local chunk
                # without any communication.
                d = distribute_tensor(p.data, mesh, [Shard(0)], src_data_rank=None)
                module.register_parameter(pname, nn.Parameter(d, requires_grad=p.requires_grad))

        distribute_module(moe.experts, ep_mesh, shard, input_fn=dispatch.before, output_fn=dispatch.after)
    if blocks:
        log.info(
            "applied expert parallel over %d ranks to %d MoE blocks (%d experts each, %d per rank)",
            ep_mesh.size(),
            len(blocks),
            blocks[0].n_experts,
            blocks[0].n_experts // ep_mesh.size(),
        )
    return model


def is_expert_param(p: torch.Tensor) -> bool:
    """Whether a parameter is sharded over an ep mesh dim (apply_ep's experts, FSDP-wrapped or not)."""
    return isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())


def _mesh_key(t: torch.Tensor) -> object:
    return t.device_mesh if isinstance(t, DTensor) else None


def group_by_mesh(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors split by the DTensor mesh they live on (plain tensors together), in first-seen order: a foreach
    kernel over DTensors of different meshes is refused, so norms and updates run once per group."""
    groups: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(_mesh_key(t), []).append(t)
    return list(groups.values())


def total_grad_norm(grads: list[torch.Tensor], pp_mesh: DeviceMesh | None = None) -> torch.Tensor:
    """The global L2 norm of gradients that may live on different meshes (experts on dp_mod_ep x ep, dense
    weights on dp_shard): each mesh's group is normed on its own and made whole (full_tensor sums the shards'
    squares), then the squares are added; over the pp group too when the stages hold different parameters."""
    sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
    for group in group_by_mesh(grads):
        norm = torch.nn.utils.get_total_norm(group, 2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        sq = sq + norm.float() ** 2
    if pp_mesh is not None:
        dist.all_reduce(sq, group=pp_mesh.get_group())
    return sq.sqrt()


def clip_grad_norm_mixed(
    params: list[nn.Parameter], max_norm: float, pp_mesh: DeviceMesh | None = None
) -> torch.Tensor:
    """torch's clip_grad_norm_ for parameters on several meshes (and pipeline stages): the one global norm, and
    every group scaled by the same coefficient."""
    params = [p for p in params if p.grad is not None]
    total = total_grad_norm([p.grad for p in params], pp_mesh)
    if 0 < max_norm < math.inf:
        for group in group_by_mesh(params):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total


def meshes_mixed(params: Iterable[torch.Tensor]) -> bool:
    """Whether the gradients live on more than one mesh (expert parallel), so torch's one-list norm cannot run."""
    return len({_mesh_key(p) for p in params}) > 1
