"""Data parallelism: replicate the model and average gradients across ranks."""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

log = logging.getLogger(__name__)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, *, bucket_mb: int) -> nn.Module:
    """Wrap in DDP (Li et al. 2020): bucketed gradient all-reduce overlapped with backward.

    Buffers are not broadcast: the only buffer (RoPE tables) is computed identically on every rank.
    """
    device_ids = [model.rope.device.index] if model.rope.device.type == "cuda" else None
    wrapped = DDP(
        model,
        process_group=dp_mesh.get_group(),
        device_ids=device_ids,
        bucket_cap_mb=bucket_mb,
        broadcast_buffers=False,
        gradient_as_bucket_view=True,
    )
    log.info("applied DDP over %d ranks, %d MiB buckets", dp_mesh.size(), bucket_mb)
    return wrapped
