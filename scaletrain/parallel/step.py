"""One optimizer step's forward/backward and gradient clipping, whatever the parallel layout: micro-batches with
gradient accumulation (DDP syncs only on the last), context-parallel sequence sharding, the tensor-parallel loss,
or a pipeline schedule; and evaluation with the same forward. The train loop calls `forward_backward`, `clip`,
then steps its optimizers."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from scaletrain.config import ParallelConfig, PrecisionConfig, TrainingConfig
from scaletrain.models.attention import document_ids
from scaletrain.models.loss import token_mean
from scaletrain.models.moe import set_aux_loss_scale
from scaletrain.parallel.comm import CommMeter
from scaletrain.parallel.context_parallel import cp_shard_batch
from scaletrain.parallel.expert_parallel import clip_grad_norm_mixed, meshes_mixed
from scaletrain.parallel.mesh import ParallelDims
from scaletrain.parallel.parallelize import ParallelModel
from scaletrain.parallel.pipeline import clip_grad_norm_pp
from scaletrain.parallel.tensor_parallel import loss_context
from scaletrain.precision.policy import Precision, resolve_precision
from scaletrain.precision.scaler import LossScaler


class ComputeClock(Protocol):
    """What the step brackets its compute with: resilience/busy.py's BusyClock, or nothing."""

    def compute_start(self) -> None: ...
    def compute_end(self) -> None: ...


class _NoClock:
    def compute_start(self) -> None:
        pass

    def compute_end(self) -> None:
        pass


@dataclass
class StepRunner:
    parts: list[nn.Module]
    micro_batch: int
    autocast: contextlib.AbstractContextManager
    grad_clip: float
    loss_context: object = contextlib.nullcontext  # a callable returning a context (TP's loss_parallel)
    cp_shard: object = None  # (inputs, targets) -> (inputs, targets, positions) under context parallel
    pipeline: object = None  # PipelineParts under pipeline parallel
    pp_mesh: object = None
    grad_sync: str = "step"  # parallel.grad_sync: when FSDP reduce-scatters under gradient accumulation
    # data.document_mask: the end-of-document id, from which each micro-batch's document ids are derived here,
    # from the input tokens, rather than handed over by the loader: the loader's (inputs, targets) interface,
    # its checkpointed state and the fault wrappers stay as they are, and evaluation gets the same masks.
    eod_id: int | None = None
    scaler: LossScaler | None = None  # fp16: the loss scaled before backward, the gradients unscaled in clip
    comm: CommMeter = field(default_factory=CommMeter)  # data-parallel bytes sent per step (comm_bytes)
    # Straggler detection's busy clock (the guard's, resilience/busy.py): the step's compute is bracketed on it
    # (CUDA events on a GPU). Handed in, so that parallelism imports nothing of resilience.
    clock: ComputeClock = field(default_factory=_NoClock)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss over this rank's share of the global batch, gradients accumulated into .grad.

        Each micro-batch loss is divided by the number of micro-batches, so the summed gradient is the mean over
        the rank's sequences; data parallelism then averages over ranks: the mean over the global batch. The count
        is this step's (a batch ramp's early steps have fewer), so a smaller step is the mean over its own tokens."""
        self.comm.step_started()
        inputs, targets, positions = self._shard(inputs, targets)
        if self.pipeline is not None:
            assert self.eod_id is None, "validate refuses data.document_mask with pp > 1"
            # The schedule calls the stage modules itself: autocast must wrap the whole step. Under context parallel
            # each stage gets its tokens' positions from apply_cp's hook.
            self._scale_aux_losses(self.pipeline.schedule._n_microbatches)  # no public accessor (torch 2.13)
            self.clock.compute_start()
            with self.autocast:
                loss = self.pipeline.step(inputs, targets)  # under fp16 the schedule's loss_fn scaled it
            self.clock.compute_end()
            return loss / self.scaler.scale if self.scaler is not None else loss
        model = self.parts[0]
        xs, ys = inputs.split(self.micro_batch), targets.split(self.micro_batch)
        n = len(xs)
        self._scale_aux_losses(n)
        loss_sum = torch.zeros((), device=inputs.device)
        self.clock.compute_start()
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            with self._grad_sync(model, last=i == n - 1), self.loss_context():
                loss = token_mean(self._loss_sum(model, x, y, positions), y)
                if (
                    i == n - 1
                ):  # the last backward's gradient collectives wait for the slowest peer: not busy time
                    self.clock.compute_end()
                share = loss / n
                (self.scaler.scale_loss(share) if self.scaler is not None else share).backward()
            loss_sum += _local(loss.detach())
        return loss_sum / n

    def _scale_aux_losses(self, n_micro: int) -> None:
        """MoE's aux and z losses reach backward with the LM loss's factor, 1/n_micro (x the fp16 loss scale), so
        their weight is the same in every layout (set on each MoE layer, which hands it to backward)."""
        scale = (self.scaler.scale if self.scaler is not None else 1.0) / n_micro
        for part in self.parts:
            set_aux_loss_scale(part, scale)

    def _grad_sync(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """Reduce gradients over data-parallel ranks after the last micro-batch only: DDP's no_sync, and FSDP2's
        gradient-sync switch (unless parallel.grad_sync = micro_batch trades the traffic for sharded memory)."""
        if isinstance(model, DDP):
            return contextlib.nullcontext() if last else model.no_sync()
        if isinstance(model, FSDPModule) and self.grad_sync == "step":
            model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def _shard(self, inputs: torch.Tensor, targets: torch.Tensor):
        """This rank's part of each sequence under context parallel (with its original positions), else as is."""
        if self.cp_shard is None:
            return inputs, targets, None
        return self.cp_shard(inputs, targets)

    def _loss_sum(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """The summed token loss: the model computes it in its forward from the targets (models/loss.py's
        `output_loss`, which never holds the whole logits)."""
        kwargs = {"targets": y}
        if positions is not None:
            kwargs["positions"] = positions
        if self.eod_id is not None:
            kwargs["document_ids"] = document_ids(x, self.eod_id)
        with self.autocast:
            return model(x, **kwargs)

    def clip(self) -> torch.Tensor:
        """The global gradient norm (over every shard and stage), clipping to grad_clip when it is > 0. Under fp16
        the gradients are unscaled first, so the norm and the clipping see their true values."""
        params = [p for part in self.parts for p in part.parameters() if p.grad is not None]
        if self.scaler is not None:
            self.scaler.unscale_([p.grad for p in params])
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        if meshes_mixed(params):  # expert parallel: experts and dense weights on different meshes
            return clip_grad_norm_mixed(params, max_norm, self.pp_mesh)
        if self.pp_mesh is not None:
            return clip_grad_norm_pp(params, max_norm, self.pp_mesh)
        return _local(nn.utils.clip_grad_norm_(params, max_norm, foreach=True))

    def loss_scale_overflow(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """fp16: advance the loss scale after `clip`; True when this step's scaled gradients overflowed, so it must
        be skipped (the scale is lowered). Every rank decides alike: the gradient norm is global. Such a step is
        the scaler's business, not a training anomaly: the caller skips it without consulting the guard."""
        return self.scaler is not None and self.scaler.update_from(loss, grad_norm)

    def resumable(self) -> dict[str, LossScaler]:
        """What the checkpoint must hold of the step itself: fp16's loss scaler, under "scaler"; {} otherwise."""
        return {"scaler": self.scaler} if self.scaler is not None else {}

    def scale_metrics(self) -> dict[str, float]:
        """fp16: the loss scale and the steps skipped on overflow, for metrics.jsonl; {} otherwise."""
        return self.scaler.metrics() if self.scaler is not None else {}

    @torch.no_grad()
    def eval_loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Summed validation loss and token count over a batch (forward only)."""
        inputs, targets, positions = self._shard(inputs, targets)
        if self.pipeline is not None:
            assert self.eod_id is None, "validate refuses data.document_mask with pp > 1"
            with self.autocast:
                return self.pipeline.eval_sum(inputs, targets)
        with self.loss_context():
            total = _local(self._loss_sum(self.parts[0], inputs, targets, positions))
        return total, targets.numel()


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward's context when precision.compute is applied by autocast (fp32 weights and optimizer): bf16 or
    fp16 autocast, none for fp32."""
    return Precision(precision, "none" if precision == "fp32" else "autocast", device.type).autocast()


def build_step_runner(
    pm: ParallelModel,
    dims: ParallelDims,
    pcfg: ParallelConfig,
    tcfg: TrainingConfig,
    device: torch.device,
    eod_id: int | None = None,
    precision: Precision | None = None,
) -> StepRunner:
    """The step for a parallelised model: what training, evaluation and the equivalence tests all run. eod_id:
    the tokenizer's end-of-document id when data.document_mask is on, else None. precision: the one `parallelize`
    got; without one, fp32."""
    if precision is None:
        precision = resolve_precision(PrecisionConfig(), False, device.type)
    cp_shard = None
    if dims.cp_enabled:
        cp_mesh = dims.submesh("cp")

        def cp_shard(x: torch.Tensor, y: torch.Tensor):
            return cp_shard_batch(x, y, cp_mesh, pcfg.cp_load_balance)

    return StepRunner(
        pm.parts,
        tcfg.micro_batch,
        precision.autocast(),
        tcfg.grad_clip,
        loss_context=lambda: loss_context(pm.loss_parallel),
        cp_shard=cp_shard,
        pipeline=pm.pipeline,
        pp_mesh=dims.submesh("pp") if dims.pp_enabled else None,
        grad_sync=pcfg.grad_sync,
        eod_id=eod_id,
        scaler=precision.scaler,
        comm=pm.comm,
    )


@torch.no_grad()
def evaluate(
    runner: StepRunner, loader, tcfg: TrainingConfig, dims: ParallelDims, device: torch.device
) -> float:
    """Mean validation loss per token over the held-out sequences (sharded over data-parallel ranks)."""
    for part in runner.parts:
        part.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in loader.val_batches(tcfg.eval_sequences, tcfg.micro_batch):
        loss_sum, n = runner.eval_loss_sum(x.to(device), y.to(device))
        total[0] += loss_sum
        total[1] += n
    for part in runner.parts:
        part.train()
    mesh = dims.submesh("dp_cp")
    if mesh is not None:
        dist.all_reduce(total, group=mesh.get_group())
    return (total[0] / total[1]).item()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (a loss or norm under TP/FSDP) as a plain tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


@dataclass
class Evaluation:
    """Validation during training (training.eval_interval) with the step's own forward: each result kept by step,
    its time excluded from throughput (`exclude`), an `eval` event written (`event`)."""

    runner: StepRunner
    loader: object
    training: TrainingConfig
    dims: ParallelDims
    device: torch.device
    event: Callable[..., None]
    exclude: Callable[[float], None]
    results: dict[int, float] = field(default_factory=dict)

    def due(self, step: int) -> bool:
        t = self.training
        return bool(t.eval_interval) and (step % t.eval_interval == 0 or step == t.steps)

    def __call__(self, step: int) -> float:
        t0 = time.perf_counter()
        val = evaluate(self.runner, self.loader, self.training, self.dims, self.device)
        self.results[step] = val
        duration = time.perf_counter() - t0
        self.exclude(duration)  # evaluation is not training time
        self.event("eval", step=step, val_loss=val, val_ppl=math.exp(min(val, 50)), duration_s=duration)
        return val
