"""AdamW with decay only on matrices, and the learning-rate schedules (warmup then cosine, linear, WSD, constant)."""

from __future__ import annotations

import math

import torch
from torch import nn

from scaletrain.config import OptimizerConfig


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device) -> torch.optim.AdamW:
    """Norm weights and biases (1-D tensors) get no weight decay: shrinking them only fights the normalisation."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if device.type == "cuda" else "foreach"
    kwargs = {"fused": impl == "fused", "foreach": impl == "foreach"}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kwargs)


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
