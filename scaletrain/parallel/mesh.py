"""Process-group start-up and the one object that knows the device mesh (no process-group globals)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_pref: str, timeout_s: float = 600.0) -> DistEnv:
    """Join the process group that torchrun describes in the environment (gloo on CPU, NCCL on GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    use_cuda = device_pref == "cuda" or (device_pref == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if use_cuda else None,
        )
    return DistEnv(rank, world, local_rank, local_world, device)


@dataclass
class ParallelDims:
    """Sizes of each parallel dimension. Today: data parallel only, dp = world size."""

    dp: int

    def build_mesh(self, device: torch.device) -> DeviceMesh | None:
        if self.dp == 1:
            return None
        return init_device_mesh(device.type, (self.dp,), mesh_dim_names=("dp",))


def all_reduce_mean(t: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """Mean of a tensor over the mesh (identity on one process)."""
    if mesh is None:
        return t
    t = t.detach().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return t / mesh.size()


def broadcast_object(obj: object, mesh: DeviceMesh | None) -> object:
    """Rank 0's value of `obj` on every rank (e.g. a run directory name that contains a timestamp)."""
    if mesh is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=mesh.get_group(), group_src=0)
    return box[0]
