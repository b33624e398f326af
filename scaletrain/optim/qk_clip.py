"""QK-clip (optimizer.qk_clip = τ; MuonClip, Kimi K2, 2025): after each applied optimizer step, the query and key
projections of every attention head whose largest logit in the step exceeded τ are scaled down so that the same
batch would peak at τ. Independent of the optimizer (AdamW or Muon); docs/optimizer.md, "QK-clip"."""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from scaletrain.config import Config
from scaletrain.models.llama import Attention, ModelArgs
from scaletrain.parallel.mesh import ParallelDims

_LAYER_ID = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def attention_layers(parts: list[nn.Module]) -> dict[int, Attention]:
    """The attention modules of this rank's model parts (its pipeline stages), by layer id, read from the module's
    name so that recompute, compile, DDP and FSDP wrappers do not matter."""
    found: dict[int, Attention] = {}
    for part in parts:
        for name, module in part.named_modules():
            if isinstance(module, Attention) and (m := _LAYER_ID.search(name + ".")):
                found[int(m.group(1))] = module
    return found


def qk_clip_problems(cfg: Config) -> list[str]:
    """optimizer.qk_clip against the layout and the training options: what it cannot measure is refused."""
    tau = cfg.optimizer.qk_clip
    if tau == 0:
        return []
    if not (tau > 0 and math.isfinite(tau)):
        return [f"optimizer.qk_clip must be > 0 (the logit threshold τ, e.g. 100) or 0 (off), got {tau}"]
    problems = []
    if cfg.parallel.cp > 1:
        problems.append(
            "optimizer.qk_clip with parallel.cp > 1 is refused: under context parallel each rank holds a slice of "
            "the keys and ring attention never forms a whole row of logits, so a head's maximum would need every "
            "rank's keys; set parallel.cp = 1 or optimizer.qk_clip = 0"
        )
    if cfg.fault_tolerance.enabled:
        problems.append(
            "optimizer.qk_clip with fault_tolerance.enabled is refused: each replica group would take the logit "
            "maximum over its own share of the batch only, and groups that clip different heads no longer hold "
            "the same weights; set fault_tolerance.enabled = false or optimizer.qk_clip = 0"
        )
    if cfg.training.compile:
        problems.append(
            "optimizer.qk_clip with training.compile is refused: the logit maximum is measured outside the "
            "compiled graph (a graph break in every block) and that path is untested; set training.compile = "
            "false or optimizer.qk_clip = 0"
        )
    return problems


def head_scales(gamma: torch.Tensor, n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors of the query heads and of the key heads for one layer, from γ_h = min(1, τ / S_max^h) of its
    query heads. A key head is shared by the query heads of its group (grouped-query attention), so it is scaled by
    c = sqrt(the largest γ of its group) and each query head by γ_h / c: every logit of head h shrinks by exactly
    γ_h, and a group with a head under τ keeps its key (c = 1), so the heads under τ are untouched. One query head
    per key (n_kv_heads = n_heads) gives Kimi K2's split, sqrt(γ_h) on both."""
    grouped = gamma.reshape(n_kv_heads, -1)
    c = grouped.amax(dim=1).sqrt()
    return (grouped / c[:, None]).reshape(-1), c


class QKClip:
    """Reads every attention layer's per-head logit maximum of the step (`Attention.max_logits`, raised by each
    training forward: every micro-batch, every recomputed forward), takes the maximum over all ranks (one
    all-reduce on the control group: data-parallel ranks saw other samples, tensor-parallel ranks other heads,
    pipeline ranks other layers), so that every replica clips identically, and scales the rows of W_q and W_k of
    the heads over τ in place: whole tensors, or this rank's rows of a sharded one (FSDP, TP). A skipped step only
    resets the maxima. Holds no state across steps (nothing to checkpoint)."""

    def __init__(
        self,
        layers: dict[int, Attention],
        args: ModelArgs,
        tau: float,
        *,
        tp: int = 1,
        tp_rank: int = 0,
        control: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """layers: this rank's attention modules by layer id (`attention_layers`); args: the whole model's shape;
        tp, tp_rank: tensor parallel's size and this rank's place in it (a tp rank computes the tp_rank-th block of
        n_heads / tp query heads, as ColwiseParallel splits W_q's rows); control: the gloo group of the whole world (None on one process)."""
        self.layers, self.args, self.tau = layers, args, tau
        self.local_heads = args.n_heads // tp
        self.head_offset, self.control = tp_rank * self.local_heads, control
        for m in layers.values():
            m.max_logits = torch.full((self.local_heads,), -math.inf, device=device)
        self._last: dict[str, float] = {}

    @classmethod
    def for_model(
        cls, parts: list[nn.Module], args: ModelArgs, tau: float, dims: ParallelDims, device: torch.device
    ) -> QKClip | None:
        """The clip of this rank's attention layers; None when optimizer.qk_clip is 0 (off: nothing measured)."""
        if tau <= 0:
            return None
        layers = attention_layers(parts)
        return cls(
            layers, args, tau, tp=dims.tp, tp_rank=dims.local_rank("tp"), control=dims.control, device=device
        )

    @torch.no_grad()
    def step(self, applied: bool = True) -> None:
        """After the optimizer step (every rank calls it: it holds a collective). applied False: a skipped step,
        whose weights stay as they were: only reset the maxima."""
        if applied:
            table = self._global_maxima()
            gamma = torch.where(table > self.tau, self.tau / table, torch.ones_like(table))
            for i, m in self.layers.items():
                if bool((gamma[i] < 1).any()):
                    q, k = head_scales(gamma[i], self.args.n_kv_heads)
                    _scale_rows(m.wq.weight, q.repeat_interleave(m.head_dim))
                    _scale_rows(m.wk.weight, k.repeat_interleave(m.head_dim))
            self._last = {"max_attn_logit": float(table.max()), "qk_clipped_heads": int((gamma < 1).sum())}
        for m in self.layers.values():
            m.max_logits.fill_(-math.inf)

    def metrics(self) -> dict[str, float]:
        """The latest applied step's `max_attn_logit` (before the clip, over the whole model) and
        `qk_clipped_heads` (query heads clipped, over all layers)."""
        return dict(self._last)

    def _global_maxima(self) -> torch.Tensor:
        """[n_layers, n_heads] on the host: every head's maximum over the global batch (-inf where no rank holds
        the layer, which cannot happen in a whole model)."""
        table = torch.full((self.args.n_layers, self.args.n_heads), -math.inf)
        if self.layers:
            local = torch.stack([m.max_logits for m in self.layers.values()]).float().cpu()
            table[list(self.layers), self.head_offset : self.head_offset + self.local_heads] = local
        if self.control is not None:
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=self.control)
        return table


def _scale_rows(param: torch.Tensor, scale: torch.Tensor) -> None:
    """param[r, :] *= scale[r] for the whole tensor's rows r, on this rank's share: a DTensor sharded by rows
    (FSDP's dp shards, TP's heads, both) takes the matching piece of `scale`, cut as its own rows are."""
    col = scale[:, None]
    local = param
    if isinstance(param, DTensor):
        # Replicate, Shard(0), or _StridedShard(0) (FSDP over TP's row shards): all by rows.
        by_rows = all(p.is_replicate() or getattr(p, "dim", None) == 0 for p in param.placements)
        assert by_rows, f"QK-clip scales rows: {param.placements}"
        col = distribute_tensor(col, param.device_mesh, param.placements, src_data_rank=None).to_local()
        local = param.to_local()
    local.mul_(col.to(local.device, local.dtype))
