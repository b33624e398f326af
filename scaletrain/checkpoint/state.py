"""Stateful wrappers: everything that resumes, as tensors only (so loading needs no unpickling), keyed by
fully-qualified parameter names (so a checkpoint loads into any parallel layout)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


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


class OptimizerState(Stateful):
    """Optimizer state flattened to `state.<fqn>.<key>` so stages and shards merge and reshard by name."""

    def __init__(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]):
        self.pairs = list(zip(parts, optimizers, strict=True))

    def state_dict(self) -> dict:
        sd = {}
        for part, opt in self.pairs:
            sd.update(get_optimizer_state_dict(part, opt, options=_FLAT))
        return sd

    def load_state_dict(self, sd: dict) -> None:
        for part, opt in self.pairs:
            # The learning rate belongs to the schedule of the run now starting (its length may have changed);
            # only moments and step counts come from the checkpoint.
            keep = [{k: g[k] for k in ("lr", "initial_lr") if k in g} for g in opt.param_groups]
            set_optimizer_state_dict(part, opt, sd, options=_FLAT)
            for group, kept in zip(opt.param_groups, keep, strict=True):
                group.update(kept)


class SchedulerState(Stateful):
    """The LR schedule is a function of the step; only the step is saved."""

    def __init__(self, schedulers: list):
        self.schedulers = schedulers

    def state_dict(self) -> dict:
        return {"last_epoch": torch.tensor(self.schedulers[0].last_epoch)}

    def load_state_dict(self, sd: dict) -> None:
        for sched in self.schedulers:
            sched.last_epoch = int(sd["last_epoch"])
            lrs = [
                base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas, strict=True)
            ]
            for group, lr in zip(sched.optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr
            sched._last_lr = lrs


class LoaderState(Stateful):
    """The data position: the next global sample index (valid for any data-parallel size)."""

    def __init__(self, loader):
        self.loader = loader

    def state_dict(self) -> dict:
        return {k: torch.tensor(v) for k, v in self.loader.state_dict().items()}

    def load_state_dict(self, sd: dict) -> None:
        self.loader.load_state_dict({k: int(v) for k, v in sd.items()})


class TrainState(Stateful):
    """Step, tokens seen and every rank's RNG state (gathered, so a restart with another world size finds one)."""

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
