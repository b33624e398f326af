"""Mixture-of-experts bookkeeping after each optimizer step: the experts' load summed over the data-parallel ranks,
the moe_* metrics and the `moe_imbalance` event (docs/moe.md). It only reads the model (and clears the load buffers
it has read); the routing-bias update, a training rule, is scaletrain.optim.optimizers.RoutingBias."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from scaletrain.config import MoEConfig
from scaletrain.models.moe import MoE
from scaletrain.parallel.mesh import ParallelDims

# One row per layer of the whole model: the E per-expert counts, then these scalars.
_DROPPED, _ROUTED, _AUX, _Z, _FORWARDS, _PRESENT = range(6)
_LAYER_ID = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def moe_layers(parts: list[nn.Module]) -> dict[int, MoE]:
    """The MoE feed-forwards of this rank's model parts (its pipeline stages), by layer id. The id is read from the
    module's name, so the wrappers that recompute, compile or FSDP put around a block do not matter."""
    found: dict[int, MoE] = {}
    for part in parts:
        for name, module in part.named_modules():
            if isinstance(module, MoE) and (m := _LAYER_ID.search(name + ".")):
                found[int(m.group(1))] = module
    return found


class MoEMonitor:
    """After each optimizer step (`step_done`): read and reset every MoE layer's load buffers, sum them over the
    data-parallel (and context-parallel) ranks, keep the figures for `metrics()` and watch for a layer that stays
    imbalanced. Stateful: the imbalance streaks resume. The routing biases were moved by `Optimizers.step` from the
    same buffers just before (scaletrain.optim.optimizers.RoutingBias).

    Under pipeline parallel each stage holds only its own layers; their rows are summed over the pp ranks too
    (every other stage contributes zeros), so every rank, rank 0 included, reports and watches every layer.

    Under activation recompute a block's forward runs twice with gradients on; MoE skips the recomputed one (it
    runs inside backward). Were both counted, the counts, loss sums and forwards would double alike, and every
    ratio reported here (and the sign that moves the bias) would be unchanged.
    """

    def __init__(
        self,
        layers: dict[int, MoE],
        n_layers: int,
        n_experts: int,
        cfg: MoEConfig,
        *,
        dp_cp: DeviceMesh | None = None,
        pp: DeviceMesh | None = None,
        event: Callable[..., None] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """layers: this rank's MoE modules by layer id (`moe_layers`); n_layers: the whole model's; dp_cp: the
        ranks whose counts are summed; pp: the pipeline ranks (None without pp); event: MetricsWriter.event;
        device: where the model's buffers live (a stage without MoE layers still joins the pipeline's sum)."""
        self.layers, self.n_layers, self.n_experts, self.cfg = layers, n_layers, n_experts, cfg
        self.dp_cp, self.pp, self.event, self.device = dp_cp, pp, event, torch.device(device)
        self.streak = torch.zeros(n_layers, dtype=torch.int64)
        """Consecutive steps each layer's max/mean load has been above moe.imbalance_threshold."""
        self.alerted = torch.zeros(n_layers, dtype=torch.int64)
        """1 while a layer's current imbalance episode has had its event (cleared when it comes back under)."""
        self._last: dict[str, float] = {}
        self._ratios: dict[int, float] = {}  # the latest step's max/mean load of each MoE layer

    @classmethod
    def for_model(
        cls, parts: list[nn.Module], n_layers: int, n_experts: int, cfg: MoEConfig, dims: ParallelDims, event
    ) -> MoEMonitor:
        """The monitor of this rank's parts, summing over the data-parallel and pipeline ranks of `dims`."""
        pp = dims.submesh("pp") if dims.pp_enabled else None
        layers = moe_layers(parts)
        # The mesh's device type (the current CUDA device on GPUs), not a parameter's: offloaded parameters live
        # on the host while the buffers and the collectives stay on the accelerator.
        device = next((m.tokens_per_expert.device for m in layers.values()), torch.device("cpu"))
        if dims.mesh is not None:
            device = torch.device(dims.mesh.device_type)
        return cls(
            layers, n_layers, n_experts, cfg, dp_cp=dims.submesh("dp_cp"), pp=pp, event=event, device=device
        )

    @property
    def active(self) -> bool:
        """Whether the model has MoE layers (on some stage: under pp a stage of dense blocks still takes part)."""
        return self.n_experts > 0

    def resumable(self) -> dict[str, MoEMonitor]:
        """What the checkpoint holds of it: {"moe": self} for a MoE model, {} for a dense one."""
        return {"moe": self} if self.active else {}

    def step_done(self, step: int, applied: bool = True) -> None:
        """After the optimizer step. `applied` False (a skipped step) only clears the buffers: its batch does not
        count towards an imbalance. Every rank calls this (it holds collectives)."""
        if not self.active:
            return
        if applied:
            rows = _all_reduce_sum(self._local_rows(), self.dp_cp)
            # One small host copy per step: the imbalance watch needs every step's figures on the host.
            rows = _all_reduce_sum(rows, self.pp).double().cpu()
            self._last = self._summarise(rows)
            self._watch(step)
        self._reset()

    def metrics(self) -> dict[str, float]:
        """The latest applied step's figures for metrics.jsonl (flat keys, so TensorBoard plots each); {} for a
        dense model."""
        return dict(self._last)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"streak": self.streak, "alerted": self.alerted}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.streak = torch.as_tensor(sd["streak"]).to(torch.int64).clone()
        self.alerted = torch.as_tensor(sd["alerted"]).to(torch.int64).clone()

    def _local_rows(self) -> torch.Tensor:
        """[n_layers, E + 6]: this rank's buffers, zeros for the layers it does not hold."""
        rows = torch.zeros(self.n_layers, self.n_experts + 6, dtype=torch.float32, device=self.device)
        for i, m in self.layers.items():
            rows[i, : self.n_experts] = _local(m.tokens_per_expert)
            extra = (m.dropped_tokens, m.routed_tokens, m.aux_loss_sum, m.z_loss_sum, m.forwards)
            rows[i, self.n_experts : self.n_experts + 5] = torch.stack([_local(t).float() for t in extra])
            rows[i, self.n_experts + _PRESENT] = 1.0
        return rows

    def _summarise(self, rows: torch.Tensor) -> dict[str, float]:
        e = self.n_experts
        out: dict[str, float] = {}
        present = [i for i in range(self.n_layers) if rows[i, e + _PRESENT] > 0]
        worst, aux, z, n = 0.0, 0.0, 0.0, 0
        for i in present:
            load = rows[i, :e]
            ratio = float(load.max() / load.mean()) if load.sum() > 0 else math.nan
            out[f"moe_load_max_mean/layer{i}"] = ratio
            worst = max(worst, ratio) if not math.isnan(ratio) else worst
            forwards = float(rows[i, e + _FORWARDS])
            if forwards > 0:  # the mean over forwards (micro-batches and ranks) of each layer's loss
                aux += float(rows[i, e + _AUX]) / forwards
                z += float(rows[i, e + _Z]) / forwards
                n += 1
        routed = float(rows[present, e + _ROUTED].sum()) if present else 0.0
        dropped = float(rows[present, e + _DROPPED].sum()) if present else 0.0
        out.update(
            moe_load_max_mean=worst,
            moe_dropped=dropped / routed if routed > 0 else 0.0,
            # Unweighted and averaged over layers (1.0: a balanced router, whatever moe.aux_loss_coef).
            moe_aux_loss=aux / n if n else 0.0,
            moe_z_loss=z / n if n else 0.0,
        )
        self._ratios = {i: out[f"moe_load_max_mean/layer{i}"] for i in present}
        return out

    def _watch(self, step: int) -> None:
        """A `moe_imbalance` event when a layer's max/mean load has been above the threshold for
        moe.imbalance_steps consecutive steps: once per episode, again only after it came back under."""
        threshold, needed = self.cfg.imbalance_threshold, self.cfg.imbalance_steps
        for i, ratio in self._ratios.items():
            if not ratio > threshold:  # NaN (no tokens) counts as balanced
                self.streak[i], self.alerted[i] = 0, 0
                continue
            self.streak[i] += 1
            if self.streak[i] >= needed and not self.alerted[i]:
                self.alerted[i] = 1
                if self.event is not None:
                    self.event(
                        "moe_imbalance",
                        step=step,
                        layer=i,
                        load_max_mean=ratio,
                        threshold=threshold,
                        steps=needed,
                    )

    def _reset(self) -> None:
        for m in self.layers.values():
            m.reset_stats()


def _all_reduce_sum(t: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    if mesh is None or mesh.size() == 1:
        return t
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=mesh.get_group())  # a 1-D mesh: never the default group
    return t


def _local(t: torch.Tensor) -> torch.Tensor:
    """A buffer's local tensor (a DTensor's, should a parallelism have made it one), to read and write in place."""
    return t.to_local() if hasattr(t, "to_local") else t
