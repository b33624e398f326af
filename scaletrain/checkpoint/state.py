"""Stateful wrappers: everything that resumes, as tensors only (so loading needs no unpickling), keyed by
fully-qualified parameter names (so a checkpoint loads into any parallel layout). The optimizers and their LR
schedule are `scaletrain.optim.Optimizers`."""

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
    """The data position: the next global sample index (valid for any data-parallel size)."""

    def __init__(self, loader):
        self.loader = loader

    def state_dict(self) -> dict:
        return {k: torch.tensor(v) for k, v in self.loader.state_dict().items()}

    def load_state_dict(self, sd: dict) -> None:
        self.loader.load_state_dict({k: int(v) for k, v in sd.items()})


class TrainState(Stateful):
    """Step, tokens seen and every rank's RNG state (gathered, so a restart with another world size finds one).

    `group` is the CPU control group (`ParallelDims.control`): the RNG rows are CPU tensors, which an NCCL group
    cannot carry."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.step = 0
        self.tokens = 0
        self.group = group
        self.saved_ranks = 0  # set before loading: how many RNG rows the checkpoint holds

    def _rng_rows(self) -> torch.Tensor:
        local = torch.get_rng_state()
        if self.group is None:
            return local.unsqueeze(0)
        rows = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(rows, local, group=self.group)
        return torch.stack(rows)

    def state_dict(self) -> dict:
        rng = (
            torch.empty(self.saved_ranks, torch.get_rng_state().numel(), dtype=torch.uint8)
            if self.saved_ranks
            else self._rng_rows()
        )
        return {"step": torch.tensor(self.step), "tokens": torch.tensor(self.tokens), "rng": rng}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.tokens = int(sd["step"]), int(sd["tokens"])
        rank = dist.get_rank(self.group) if self.group is not None else 0
        if rank < sd["rng"].shape[0]:
            torch.set_rng_state(sd["rng"][rank].clone())
        self.saved_ranks = 0
