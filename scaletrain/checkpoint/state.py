"""Stateful wrappers: everything that resumes, as tensors only (so loading needs no unpickling), keyed by
fully-qualified parameter names (so a checkpoint loads into any parallel layout). The optimizers and their LR
schedule are `scaletrain.optim.optimizers.Optimizers`."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful


class ModelState(Stateful):
    """The model, possibly several pipeline stages on this rank; DDP/FSDP/TP wrappers are seen through."""

    def __init__(self, parts: list[nn.Module]):
        self.parts = parts

    def state_dict(self) -> dict:
        sd = {}
        for part in self.parts:
            sd.update(get_model_state_dict(part))
        return sd

    def load_state_dict(self, sd: dict) -> None:
        for part in self.parts:
            set_model_state_dict(part, sd, options=StateDictOptions(strict=False))


class LoaderState(Stateful):
    """The data position, valid for any data-parallel size: the next global sample index, and with data.streaming
    each source's position (integers) and mixing credit (a float64)."""

    def __init__(self, loader):
        self.loader = loader

    def state_dict(self) -> dict:
        return {
            k: torch.tensor(v, dtype=torch.float64 if isinstance(v, float) else torch.int64)
            for k, v in self.loader.state_dict().items()
        }

    def load_state_dict(self, sd: dict) -> None:
        self.loader.load_state_dict({k: v.item() for k, v in sd.items()})


class TrainState(Stateful):
    """Step, tokens seen and every rank's RNG state (gathered, so a restart with another world size finds one): the
    CPU generator's, and on CUDA the device generator's too (dropout and any sampling on the GPU draw from it).

    `group` is the CPU control group (`ParallelDims.control`): the RNG rows are CPU tensors, which an NCCL group
    cannot carry. `device`: the run's device; its CUDA generator is saved when it is a CUDA device."""

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | None = None):
        self.step = 0
        self.tokens = 0
        self.group = group
        self.cuda = device if device is not None and device.type == "cuda" else None
        # Set before loading: how many RNG rows the checkpoint holds, and the shape of its CUDA rows (None when it
        # has none: saved on CPU, or before CUDA RNG states were saved).
        self.saved_ranks = 0
        self.saved_cuda_shape: tuple[int, ...] | None = None

    def _rows(self, local: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return local.unsqueeze(0)
        rows = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(rows, local, group=self.group)
        return torch.stack(rows)

    def state_dict(self) -> dict:
        sd = {"step": torch.tensor(self.step), "tokens": torch.tensor(self.tokens)}
        if self.saved_ranks:  # loading: placeholders of the saved shapes, filled by DCP
            sd["rng"] = torch.empty(self.saved_ranks, torch.get_rng_state().numel(), dtype=torch.uint8)
            if self.saved_cuda_shape is not None:
                sd["cuda_rng"] = torch.empty(self.saved_cuda_shape, dtype=torch.uint8)
            return sd
        sd["rng"] = self._rows(torch.get_rng_state())
        if self.cuda is not None:
            sd["cuda_rng"] = self._rows(torch.cuda.get_rng_state(self.cuda))
        return sd

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.tokens = int(sd["step"]), int(sd["tokens"])
        rank = dist.get_rank(self.group) if self.group is not None else 0
        if rank < sd["rng"].shape[0]:
            torch.set_rng_state(sd["rng"][rank].clone())
        cuda_rng = sd.get("cuda_rng")
        if self.cuda is not None and cuda_rng is not None and rank < cuda_rng.shape[0]:
            torch.cuda.set_rng_state(cuda_rng[rank].clone(), self.cuda)
        self.saved_ranks, self.saved_cuda_shape = 0, None
