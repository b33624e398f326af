"""Dynamic loss scaling for fp16 (Micikevicius et al. 2018, "Mixed Precision Training"): scale the loss so that
small gradients survive fp16, unscale before clipping, skip the step and halve the scale on an overflow, double it
after a run of clean steps. Stateful, so the scale and its counters are in every checkpoint.

Why not `torch.amp.GradScaler`: its overflow check (`found_inf`) is per rank, which under FSDP2/TP shards is only
this rank's part of the gradient, and its sharded variant (`torch.distributed.fsdp.ShardedGradScaler`, written for
FSDP1) all-reduces that flag over the implicit default group; both wrap `optimizer.step` themselves, one optimizer
at a time, and neither can reach the loss a pipeline schedule computes inside itself. Here the decision is taken
from the global gradient norm that `StepRunner.clip` computes anyway: every layout already reduces it over every
rank that holds a gradient shard (FSDP's reduce-scatter, TP's DTensor norms, the pipeline's pp all-reduce, DDP's
identical replicas), so an inf on any rank makes the norm inf on all of them and every rank skips the same step,
with no collective of its own."""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor


class LossScaler(Stateful):
    """The loss scale and what it has done: `scale_loss` before backward, `unscale_` before clipping, `update`
    after the global gradient norm is known.

    An overflow (non-finite gradients from a finite loss) is a property of the scale, not of the model: the step is
    skipped and the scale halved, and the caller must not count it as a training anomaly. A non-finite loss, or an
    overflow at `min_scale` already, is not something a smaller scale can cure: `update` leaves those to the
    training guard (resilience.nan_check), which skips, counts and eventually rolls back."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
    ) -> None:
        if init_scale <= 0 or growth_interval < 1 or growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError(
                "loss scaler: init_scale must be > 0, growth_interval >= 1, growth_factor > 1 and backoff_factor "
                f"in (0, 1); got {init_scale}, {growth_interval}, {growth_factor}, {backoff_factor}"
            )
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.min_scale = min_scale
        self.growth_tracker = 0
        """Clean steps since the scale last changed."""
        self.skipped = 0
        """Steps skipped because their gradients overflowed (the guard's skips are not counted here)."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on. A power-of-two scale multiplies exactly (only the exponent changes)."""
        return loss * self.scale

    @torch.no_grad()
    def unscale_(self, grads: list[torch.Tensor]) -> None:
        """Divide the gradients by the scale in place (each rank its own shards). inf and NaN stay non-finite, so the
        norm computed next sees them."""
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        if local:
            torch._foreach_mul_(local, 1.0 / self.scale)

    def update(self, loss_finite: bool, grads_finite: bool) -> bool:
        """Advance the scale after a step; True when the step overflowed and must be skipped (the scale is then
        lowered). Pass the same facts on every rank (the global loss and gradient norm) so all ranks agree."""
        if grads_finite:
            self.growth_tracker += 1
            if self.growth_tracker >= self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0
            return False
        self.growth_tracker = 0
        if not loss_finite or self.scale <= self.min_scale:
            return False  # the guard's to judge: no scale would have made these gradients finite
        self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        self.skipped += 1
        return True

    def update_from(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """`update` from the step's loss and global gradient norm (one host transfer for both)."""
        loss_v, norm_v = torch.stack([t.detach().float().reshape(()) for t in (loss, grad_norm)]).tolist()
        return self.update(math.isfinite(loss_v), math.isfinite(norm_v))

    def metrics(self) -> dict[str, float]:
        """What metrics.jsonl records each logged step."""
        return {"loss_scale": self.scale, "overflow_skipped": self.skipped}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "scale": torch.tensor(self.scale, dtype=torch.float64),
            "growth_tracker": torch.tensor(self.growth_tracker),
            "skipped": torch.tensor(self.skipped),
        }

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.scale = float(sd["scale"])
        self.growth_tracker = int(sd["growth_tracker"])
        self.skipped = int(sd["skipped"])
