"""AdamW with decay only on matrices, the learning-rate schedules (warmup then cosine, linear, WSD, constant), and
`Optimizers`: every part's optimizer and schedule, stepped and checkpointed as one."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from scaletrain.config import OptimizerConfig


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device) -> torch.optim.AdamW:
    """Norm weights and biases (1-D tensors) get no weight decay: shrinking them only fights the normalisation."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": part, "weight_decay": wd}
        for ps, wd in ((decay, cfg.weight_decay), (no_decay, 0.0))
        for part in _by_mesh(ps)
    ]
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if device.type == "cuda" else "foreach"
    kwargs = {"fused": impl == "fused", "foreach": impl == "foreach"}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kwargs)


def _by_mesh(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters split by the DTensor mesh they live on (expert parallel's experts and the dense weights differ):
    foreach/fused AdamW runs one kernel over a group, and a DTensor op refuses operands on different meshes. One
    mesh (every other layout): the one list, as it was."""
    by: dict[object, list[nn.Parameter]] = {}
    for p in params:
        by.setdefault(getattr(p, "device_mesh", None), []).append(p)
    return list(by.values()) if len(by) > 1 else [params]


def lr_factor(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """Multiplier of the peak lr for the update with index `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    floor = cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "wsd":
        # Warmup-stable-decay (Hu et al. 2024, MiniCPM): flat at the peak, then a linear decay at the end.
        decay_steps = max(1, round(cfg.decay_fraction * total_steps))
        into_decay = step - (total_steps - decay_steps)
        if into_decay < 0:
            return 1.0
        return 1.0 - (1.0 - floor) * min(1.0, (into_decay + 1) / decay_steps)
    progress = min(1.0, (step - cfg.warmup_steps + 1) / max(1, total_steps - cfg.warmup_steps))
    if cfg.schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(opt: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int):
    """A LambdaLR: Stateful (its step count is saved), the shape itself comes from the config."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, cfg, total_steps))


# Optimizer state flattened to `state.<fqn>.<key>`, so pipeline stages and shards merge and reshard by name.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Optimizers(Stateful):
    """Every part's optimizer (one per pipeline stage on this rank) and its LR schedule, stepped together.

    `step(skip=...)` is the one place that decides what a step advances. A skipped step (non-finite gradients)
    drops its gradients and leaves the weights and moments as they were, but it still consumed its batch, so the
    LR schedule advances with the step count: the learning rate stays a function of the step, a resumed run finds
    the schedule where the step counter says, and the run ends on the schedule's last value."""

    def __init__(
        self,
        parts: list[nn.Module],
        build: Callable[[nn.Module], torch.optim.Optimizer],
        cfg: OptimizerConfig,
        total_steps: int,
    ) -> None:
        self.parts = parts
        self.optimizers = [build(part) for part in parts]
        self.schedulers = [build_lr_scheduler(o, cfg, total_steps) for o in self.optimizers]

    @property
    def lr(self) -> float:
        """The learning rate of the coming update."""
        return self.schedulers[0].get_last_lr()[0]

    def step(self, *, skip: bool = False) -> None:
        for opt, sched in zip(self.optimizers, self.schedulers, strict=True):
            if not skip:
                opt.step()
            opt.zero_grad(set_to_none=True)  # frees the gradients; the next backward writes fresh ones
            sched.step()

    def _inner(self) -> list[torch.optim.Optimizer]:
        # ZeRO-1 keeps its rank's AdamW over its share of the parameters; checkpoints save that share by name.
        return [getattr(o, "optim", o) for o in self.optimizers]

    def state_dict(self) -> dict:
        sd: dict = {"schedule_step": torch.tensor(self.schedulers[0].last_epoch)}
        for part, opt in zip(self.parts, self._inner(), strict=True):
            sd.update(get_optimizer_state_dict(part, opt, options=_FLAT))
        return sd

    def load_state_dict(self, sd: dict) -> None:
        # The learning rate belongs to the schedule of the run now starting (its length or peak may have
        # changed): only the moments and the step come from the checkpoint.
        for part, opt in zip(self.parts, self._inner(), strict=True):
            initial = [g.get("initial_lr") for g in opt.param_groups]
            set_optimizer_state_dict(part, opt, sd, options=_FLAT)
            for group, value in zip(opt.param_groups, initial, strict=True):
                if value is not None:
                    group["initial_lr"] = value
        for sched in self.schedulers:
            sched.last_epoch = int(sd["schedule_step"])
            lrs = [
                base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas, strict=True)
            ]
            for group, lr in zip(sched.optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr
            sched._last_lr = lrs
