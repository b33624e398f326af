"""Sharded initialisation: a model built on the meta device and already parallelised (FSDP/TP/EP DTensors, a
pipeline stage's layers) gets storage for this rank's share only, set to exactly the single-process values.

How (docs/parallelism.md, "How a run starts"): the whole model's `init_plan` is walked in its RNG order from
`torch.manual_seed(seed)`, as `Transformer.init_weights` walks it on one process; each parameter is generated whole
on the run's device, one at a time, this rank keeps its piece (a DTensor's local chunk for its placements; a
pipeline stage only its own layers, still drawing the others' numbers so the sequence stays the single process's)
and the whole tensor is freed. The values are bit-identical by construction; the peak is the rank's share plus the
largest single parameter (times models.init.WHOLE_PARAM_COPIES: the truncated normal's candidate). The cost:
every rank draws every parameter's numbers (time O(model), not O(share)).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from scaletrain.models.llama import ModelArgs
from scaletrain.models.presets import build_meta_model

log = logging.getLogger(__name__)


def is_meta(module: nn.Module) -> bool:
    """Whether `module` has parameters without storage (built on meta, not yet materialised)."""
    return any(p.is_meta for p in module.parameters())


def init_walk(
    args: ModelArgs, seed: int, device: torch.device, keep: Callable[[str, torch.Tensor], None]
) -> int:
    """Generate every parameter of the whole model whole on `device`, in init order from `seed`, hand each to
    `keep(name, whole)` and free it before the next; returns the largest parameter's bytes. The RNG is left where
    the single-process init leaves it."""
    full = build_meta_model(args)  # shapes only
    shapes = dict(full.named_parameters())
    torch.manual_seed(seed)
    largest = 0
    for name, init in full.init_plan():
        meta = shapes[name]
        whole = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        init(whole)
        keep(name, whole)
        largest = max(largest, whole.numel() * whole.element_size())
        del whole
    return largest


def local_piece(param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `whole` in `param`'s layout: a DTensor's local chunk (sliced here, no communication:
    `src_data_rank=None`), else all of it."""
    if isinstance(param, DTensor):
        return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()
    return whole


@torch.no_grad()
def materialize(
    module: nn.Module,
    seed: int,
    device: torch.device,
    *,
    storage_device: torch.device | None = None,
) -> None:
    """Give `module` (a Transformer, or a pipeline stage of one, on meta and parallelised but not DDP-wrapped)
    storage for this rank's share and set it to the single-process values for `seed`. `storage_device`: where the
    shards live (the host under FSDP's CPU offload), default `device`, where the numbers are drawn (the same
    device as a single-process run's, so the same generator). A tied output is the embedding: named once."""
    args = module.args
    module.to_empty(device=storage_device or device)
    if args.tie_embeddings and module.output is not None and module.tok_embeddings is not None:
        module.output.weight = module.tok_embeddings.weight  # to_empty unties them
    module.init_buffers(device)
    own = dict(module.named_parameters())
    seen: set[str] = set()

    def keep(name: str, whole: torch.Tensor) -> None:
        param = own.get(name)
        if param is not None:
            _local(param).copy_(local_piece(param, whole))
            seen.add(name)

    largest = init_walk(args, seed, device, keep)
    missing = sorted(set(own) - seen)
    assert not missing, f"parameters the init plan does not set: {missing}"
    held = sum(_local(p).numel() * p.element_size() for p in own.values())
    log.info(
        "materialised this rank's share: %.1f MiB of parameters (largest whole parameter drawn: %.1f MiB)",
        held / 2**20,
        largest / 2**20,
    )


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p
