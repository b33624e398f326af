"""AdamW with decay only on matrices (whole, or ZeRO-1: its state sharded over the data-parallel ranks), the
learning-rate schedules (warmup then cosine, linear, WSD, constant), the MoE routing-bias update (`RoutingBias`,
DeepSeek-V3's auxiliary-loss-free balancing), and `Optimizers`: every part's optimizer and schedule, and the bias
update, stepped together and checkpointed as one; optimizer_problems checks optimizer.* before launch."""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.optim import ZeroRedundancyOptimizer

from scaletrain.config import OptimizerConfig
from scaletrain.data.ramp import BatchRamp
from scaletrain.models.llama import ModelArgs
from scaletrain.models.moe import MoE
from scaletrain.optim.muon import MUON_KEYS, Muon, hidden_matrices
from scaletrain.optim.qk_clip import QKClip
from scaletrain.parallel.mesh import ParallelDims

log = logging.getLogger(__name__)


def build_optimizer(
    model: nn.Module, cfg: OptimizerConfig, replicas: dist.ProcessGroup | None = None
) -> torch.optim.AdamW:
    """Norm weights and biases (1-D tensors) get no weight decay: shrinking them only fights the normalisation.
    optimizer.name muon: the hidden matrices (muon.hidden_matrices) form a Muon group with their own lr and decay,
    the rest stays on AdamW as above, in one `Muon` optimizer (an AdamW that also steps its Muon group);
    `replicas`, the ranks holding the same whole matrices (DDP), split its Newton-Schulz work."""
    params = [p for p in model.parameters() if p.requires_grad]
    hidden = hidden_matrices(model) if cfg.name == "muon" else []
    on_muon = {id(p) for p in hidden}
    decay = [p for p in params if p.ndim >= 2 and id(p) not in on_muon]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": part, "weight_decay": wd}
        for ps, wd in ((decay, cfg.weight_decay), (no_decay, 0.0))
        for part in _by_mesh(ps)
    ]
    impl = adamw_implementation(cfg.implementation)
    kwargs = {"fused": impl == "fused", "foreach": impl == "foreach"}
    if cfg.name == "muon":
        return _build_muon(groups, hidden, cfg, kwargs | {"replicas": replicas})
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kwargs)


def _build_muon(groups: list[dict], hidden: list[nn.Parameter], cfg: OptimizerConfig, kwargs: dict) -> Muon:
    """AdamW's groups first (Optimizers.lr reports the first group's lr: optimizer.lr's schedule), then one Muon
    group (no foreach kernel: each matrix is orthogonalised on its own)."""
    groups = [g for g in groups if g["params"]]
    muon_wd = cfg.weight_decay if cfg.muon_weight_decay is None else cfg.muon_weight_decay
    if hidden:
        muon_lr = cfg.lr if cfg.muon_lr is None else cfg.muon_lr
        groups.append({"params": hidden, "muon": True, "lr": muon_lr, "weight_decay": muon_wd})
    return Muon(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, momentum=cfg.muon_momentum,
                nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps, adjust_lr=cfg.muon_adjust_lr,
                **kwargs)  # fmt: skip


def _by_mesh(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters split by the DTensor mesh they live on (expert parallel's experts and the dense weights differ):
    foreach/fused AdamW runs one kernel over a group, and a DTensor op refuses operands on different meshes. One
    mesh (every other layout): the one list, as it was."""
    by: dict[object, list[nn.Parameter]] = {}
    for p in params:
        by.setdefault(getattr(p, "device_mesh", None), []).append(p)
    return list(by.values()) if len(by) > 1 else [params]


def build_zero1_optimizer(
    model: nn.Module, opt_cfg: OptimizerConfig, dp_mesh: DeviceMesh
) -> ZeroRedundancyOptimizer:
    """ZeRO-1 (Rajbhandari et al. 2020): each rank keeps AdamW state only for its share of the parameters, steps
    them, and broadcasts the updated values. Gradients stay whole (DDP all-reduces them).

    The param groups and AdamW settings are taken from `build_optimizer` (the single source: no decay on 1-D
    tensors), so ZeRO-1 trains exactly what the unsharded optimizer trains. ZeroRedundancyOptimizer accepts param
    groups: it partitions each group's parameters greedily by size (the running per-rank total carries across
    groups) and gives every rank's local AdamW the same groups, some possibly empty. Not supported with groups:
    `overlap_with_ddp` and a hand-made `params_per_rank`, neither used here. Muon (optimizer.name) is sharded the
    same way: its parameters are whole on every rank, so each rank's share is orthogonalised locally and the
    Newton-Schulz work is spread over the ranks by ZeRO's partition."""
    reference = build_optimizer(model, opt_cfg)  # allocates no state until its first step
    # A Muon group keeps its own keys (lr among them); each rank orthogonalises the whole matrices of its share.
    groups = [
        {"params": g["params"], "weight_decay": g["weight_decay"]}
        | ({k: g[k] for k in MUON_KEYS} if g.get("muon") else {})
        for g in reference.param_groups
    ]
    cls = type(reference)
    accepted = inspect.signature(cls).parameters
    defaults = {k: v for k, v in reference.defaults.items() if k in accepted and k != "weight_decay"}
    opt = ZeroRedundancyOptimizer(groups, cls, process_group=dp_mesh.get_group(), **defaults)
    local = sum(p.numel() for g in opt.optim.param_groups for p in g["params"])
    total = sum(p.numel() for g in groups for p in g["params"])
    log.info(
        "applied ZeRO-1 over %d ranks: this rank holds AdamW state for %.1f%% of the parameters",
        dp_mesh.size(),
        100 * local / max(total, 1),
    )
    return opt


def adamw_implementation(implementation: str) -> str:
    """optimizer.implementation resolved: auto is torch's fused AdamW, on a CPU as on CUDA. On a CPU it steps each
    tensor in one pass with no temporaries: about 5x faster than foreach on this project's 2-core hosts, and without
    foreach's sqrt(v) of every parameter, which was the peak of many runs (issue 35: a lower peak beats a larger
    estimate)."""
    if implementation == "auto":
        return "fused"
    return implementation


def optimizer_builder(
    opt_cfg: OptimizerConfig, mode: str, dp_cp: DeviceMesh | None
) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """How each model part gets its optimizer: ZeRO-1 shards AdamW's state over the data-parallel ranks, every
    other mode uses plain AdamW (FSDP/ZeRO-2 already shard what it holds). Under DDP the data-parallel ranks
    hold every matrix whole: Muon splits its Newton-Schulz work over them."""
    if mode == "zero1" and dp_cp is not None and dp_cp.size() > 1:
        return lambda part: build_zero1_optimizer(part, opt_cfg, dp_cp)
    if mode == "ddp" and dp_cp is not None and dp_cp.size() > 1:
        return lambda part: build_optimizer(part, opt_cfg, dp_cp.get_group())
    return lambda part: build_optimizer(part, opt_cfg)


def lr_factor(step: float, cfg: OptimizerConfig, total_steps: float) -> float:
    """Multiplier of the peak lr for the update with index `step` (0-based; under a batch ramp a fractional
    position in full global batches, and `total_steps` the schedule's length in them)."""
    if step < cfg.warmup_steps:
        # min: a ramp's fractional position just below warmup_steps would otherwise overshoot the peak (an integer
        # step never does, and min leaves its value as it was).
        return min(1.0, (step + 1) / cfg.warmup_steps)
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


def build_lr_scheduler(
    opt: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int, ramp: BatchRamp | None = None
):
    """A LambdaLR: Stateful (its step count is saved), the shape itself comes from the config.

    Under a batch ramp the schedule counts tokens: its position is the sequences consumed before the update, in
    full global batches (ramp.schedule_position), and its length what the run's steps consume. The ramp is a
    function of the step, so the saved step count still places a resumed (or rolled back) schedule exactly."""
    if ramp is None or not ramp.on:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, cfg, total_steps))
    length = ramp.schedule_length(total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: lr_factor(ramp.schedule_position(step), cfg, length)
    )


class RoutingBias:
    """DeepSeek-V3's auxiliary-loss-free balancing (Wang et al. 2024; moe.bias_update_rate): after each applied
    step every expert's routing bias moves by the rate towards the mean load, up when under-loaded, down when over.
    A training rule, so it steps with the optimizers; the bias only selects experts (models/moe.py). The load is the
    step's `tokens_per_expert` of each MoE layer summed over the data-parallel (and context-parallel) ranks, so the
    update is the same on every rank holding the layer and its replicas never drift apart. It reads the buffers
    before MoEMonitor (metrics) reads and clears them after the step."""

    def __init__(
        self, layers: list[MoE], n_experts: int, rate: float, dp_cp: DeviceMesh | None = None
    ) -> None:
        self.layers, self.n_experts, self.rate, self.dp_cp = layers, n_experts, rate, dp_cp

    @classmethod
    def for_model(
        cls, parts: list[nn.Module], n_experts: int, rate: float, dp_cp: DeviceMesh | None
    ) -> RoutingBias | None:
        """The update of this rank's MoE layers (its pipeline stages'); None when off or there is none to move
        (every rank of one dp_cp group holds the same layers, so they agree)."""
        layers = [m for part in parts for m in part.modules() if isinstance(m, MoE)]
        return cls(layers, n_experts, rate, dp_cp) if rate > 0 and layers else None

    @torch.no_grad()
    def step(self) -> None:
        # Float32 sums of token counts are exact (< 2^24 per expert), so the sign is the same however summed.
        load = torch.stack([_local(m.tokens_per_expert).float() for m in self.layers])
        if self.dp_cp is not None and self.dp_cp.size() > 1:  # a 1-D mesh's group: never the default group
            dist.all_reduce(load, op=dist.ReduceOp.SUM, group=self.dp_cp.get_group())
        for m, row in zip(self.layers, load, strict=True):
            bias = _local(m.router.expert_bias)
            bias.add_(self.rate * torch.sign(row.mean() - row).to(bias.dtype))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A buffer's local tensor (a DTensor's, should a parallelism have made it one), to read and write in place."""
    return t.to_local() if hasattr(t, "to_local") else t


# Optimizer state flattened to `state.<fqn>.<key>`, so pipeline stages and shards merge and reshard by name.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _set_state(part: nn.Module, opt: torch.optim.Optimizer, sd: dict) -> None:
    """set_optimizer_state_dict around the param groups that hold no parameter: DCP (torch 2.13) names a flattened
    group by its first parameter and fails on an empty one, and ZeRO-1 gives a rank an empty group when the group
    has fewer parameters than there are ranks (Muon's AdamW matrices: only the embedding and the head). They keep
    their place, so ZeRO-1 still pairs its groups with the local optimizer's by position."""
    groups = opt.param_groups
    opt.param_groups = [g for g in groups if g["params"]]
    try:
        set_optimizer_state_dict(part, opt, sd, options=_FLAT)
        loaded = iter(opt.param_groups)
        groups = [next(loaded) if g["params"] else g for g in groups]
    finally:
        opt.param_groups = groups


class Optimizers(Stateful):
    """Every part's optimizer (one per pipeline stage on this rank) and its LR schedule, stepped together, the
    MoE routing-bias update (`routing_bias`, None when off) and QK-clip (`qk_clip`, None when off).

    `step(skip=...)` is the one place that decides what a step advances. A skipped step (non-finite gradients)
    drops its gradients and leaves the weights, moments and routing biases as they were, but it still consumed its
    batch, so the LR schedule advances with the step count: the learning rate stays a function of the step, a
    resumed run finds the schedule where the step counter says, and the run ends on the schedule's last value."""

    def __init__(
        self,
        parts: list[nn.Module],
        build: Callable[[nn.Module], torch.optim.Optimizer],
        cfg: OptimizerConfig,
        total_steps: int,
        routing_bias: RoutingBias | None = None,
        ramp: BatchRamp | None = None,
        qk_clip: QKClip | None = None,
    ) -> None:
        self.parts = parts
        self.qk_clip = qk_clip
        self.optimizers = [build(part) for part in parts]
        self.schedulers = [build_lr_scheduler(o, cfg, total_steps, ramp) for o in self.optimizers]
        self.routing_bias = routing_bias

    @classmethod
    def for_model(
        cls,
        parts: list[nn.Module],
        args: ModelArgs,
        cfg: OptimizerConfig,
        data_parallel: str,
        dims: ParallelDims,
        device: torch.device,
        total_steps: int,
        routing_bias_rate: float = 0.0,
        ramp: BatchRamp | None = None,
    ) -> Optimizers:
        """The optimizers of a parallelised model's `parts` as every run builds them: AdamW or Muon (ZeRO-1's sharded
        over the data-parallel ranks), the MoE routing-bias update and QK-clip where they are on."""
        dp_cp = dims.submesh("dp_cp")  # the data-parallel ranks: optimizer shards, MoE load summed
        make_optimizer = optimizer_builder(cfg, data_parallel, dp_cp)
        bias = RoutingBias.for_model(parts, args.n_experts, routing_bias_rate, dp_cp)  # MoE balancing
        clip = QKClip.for_model(parts, args, cfg.qk_clip, dims, device)  # optimizer.qk_clip
        return cls(parts, make_optimizer, cfg, total_steps, bias, ramp, clip)

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
        if self.routing_bias is not None and not skip:
            self.routing_bias.step()  # the biases are buffers: no optimizer touches them, so order does not matter
        if self.qk_clip is not None:
            # Rescales the updated W_q/W_k; a skipped step only resets the maxima.
            self.qk_clip.step(applied=not skip)

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
            _set_state(part, opt, sd)
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


def optimizer_problems(o: OptimizerConfig) -> list[str]:
    """optimizer.* on their own: the LR schedule's and Muon's knobs."""
    problems = []
    if o.lr <= 0:
        problems.append(f"optimizer.lr must be > 0, got {o.lr}")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        problems.append(f"optimizer.betas must be two numbers in [0, 1), got {o.betas}")
    if o.eps <= 0 or o.weight_decay < 0:
        problems.append("optimizer.eps must be > 0 and optimizer.weight_decay >= 0")
    if o.warmup_steps < 0:
        problems.append("optimizer.warmup_steps must be >= 0")
    if not 0 <= o.min_lr_ratio <= 1:
        problems.append(f"optimizer.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    if not 0 < o.decay_fraction <= 1:
        problems.append(f"optimizer.decay_fraction must be in (0, 1], got {o.decay_fraction}")
    if o.muon_lr is not None and o.muon_lr <= 0:
        problems.append(f"optimizer.muon_lr must be > 0 (or unset: optimizer.lr), got {o.muon_lr}")
    if o.muon_weight_decay is not None and o.muon_weight_decay < 0:
        problems.append(f"optimizer.muon_weight_decay must be >= 0, got {o.muon_weight_decay}")
    if not 0 <= o.muon_momentum < 1:
        problems.append(f"optimizer.muon_momentum must be in [0, 1), got {o.muon_momentum}")
    if not 1 <= o.muon_ns_steps < 100:
        problems.append(f"optimizer.muon_ns_steps must be in [1, 99], got {o.muon_ns_steps}")
    return problems
