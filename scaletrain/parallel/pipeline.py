"""Pipeline parallelism: split the model into stages of whole layers, place them on the pp ranks (looped or V), and
run a `torch.distributed.pipelining` schedule whose mean loss and gradients equal the single-process `StepRunner`'s on the same batch."""

from __future__ import annotations

import copy
import functools
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from scaletrain.models.llama import Transformer, logits_unmeasured
from scaletrain.models.loss import token_mean
from scaletrain.models.moe import MoE

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

log = logging.getLogger(__name__)

# Each schedule's torch.distributed.pipelining class, by name: the module is imported where a schedule is built
# (build_schedule), because it imports torch._dynamo, 0.33 s of the start-up of every process that validates a config.
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
SINGLE_STAGE = ("gpipe", "1f1b")
V_SHAPED = ("zbv", "dualpipev")
# The zero-bubble schedules split each backward into an input-gradient pass and a later weight-gradient pass.
SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")


def reshards_after_forward(data_parallel: str, pp: int, schedule: str) -> bool:
    """Whether FSDP frees a stage's gathered weights after its forward: fsdp and hsdp do, zero2 keeps them until
    backward, and so does every mode under a zero-bubble schedule. With the weights resharded between a
    micro-batch's input-gradient and weight-gradient passes, torch 2.13 trains a different model (measured:
    grad norms 3-5% off the single-process run from step 2, tests/distributed/test_hybrid_layouts.py); kept
    gathered, they match it. The cost is ZeRO-2's memory for the stage's parameters."""
    if pp > 1 and schedule in SPLIT_BACKWARD:
        return False
    return data_parallel in ("fsdp", "hsdp")


def stages_per_rank(schedule: str, virtual_stages: int) -> int:
    """GPipe and 1F1B run one stage per rank, the V schedules exactly two, the interleaved ones `virtual_stages`."""
    if schedule in SINGLE_STAGE:
        return 1
    if schedule in V_SHAPED:
        return 2
    return virtual_stages


def placement_style(schedule: str) -> Literal["loop", "v"]:
    return "v" if schedule in V_SHAPED else "loop"


def rank_stages(pp_rank: int, pp_size: int, virtual_stages: int, style: Literal["loop", "v"]) -> list[int]:
    """Stage indices held by `pp_rank`, ascending. Loop: stage s on rank s % pp (Narayanan et al. 2021). V: rank r
    holds stages r and 2p-1-r, so the first and last stages share rank 0 and the turn of the V needs no send
    (Qi et al. 2024, zero-bubble V)."""
    if style == "v":
        return sorted({pp_rank, 2 * pp_size - 1 - pp_rank})
    return [pp_rank + i * pp_size for i in range(virtual_stages)]


def layers_per_stage(n_layers: int, n_stages: int) -> list[int]:
    """Layers of each stage, as even as possible. The remainder goes to the middle stages first: the first stage also
    runs the embedding and the last the output projection (a dim x vocab matmul, as costly as several layers when the
    vocabulary is large) and the loss, so they are the ones to get fewer layers. If the middle stages cannot take the
    whole remainder, the first stage takes one more (an embedding lookup is cheaper than the output projection)."""
    if n_stages > n_layers:
        raise ValueError(
            f"cannot split {n_layers} layers into {n_stages} pipeline stages of at least one layer each"
        )
    base, extra = divmod(n_layers, n_stages)
    counts = [base] * n_stages
    order = list(range(1, n_stages - 1)) + [0, n_stages - 1]
    for s in order[:extra]:
        counts[s] += 1
    return counts


def pipeline_problems(
    schedule: str,
    pp: int,
    virtual_stages: int,
    n_microbatches: int,
    *,
    n_layers: int | None = None,
    local_batch: int | None = None,
    tie_embeddings: bool = False,
    data_parallel: str | None = None,
    dp: int = 1,
) -> list[str]:
    """Every reason this pipeline cannot run, each with its fix (empty when it can). The micro-batch rules are those
    the torch schedules enforce (or would fail on mid-step), checked here so that they fail before any work starts."""
    if schedule not in SCHEDULES:
        return [f"parallel.pp_schedule '{schedule}' is unknown; choose one of {', '.join(SCHEDULES)}"]
    if pp < 1:
        return [f"parallel.pp must be >= 1, got {pp}"]
    problems = []
    v = stages_per_rank(schedule, virtual_stages)
    n_stages = pp * v
    if v < 1:
        problems.append(f"parallel.pp_virtual_stages must be >= 1 for {schedule}, got {virtual_stages}")
    if n_layers is not None and n_stages > n_layers:
        fix = (
            "parallel.pp or parallel.pp_virtual_stages"
            if schedule.startswith("interleaved")
            else "parallel.pp"
        )
        problems.append(
            f"the model has {n_layers} layers but {schedule} with pp={pp} needs {n_stages} stages "
            f"({v} per rank) of at least one layer each; lower {fix}, or use a model with "
            f">= {n_stages} layers"
        )
    if tie_embeddings and n_stages > 1:
        problems.append(
            "tied embeddings cannot be split over pipeline stages: the first stage (embedding) and the last "
            "(output) would each update their own copy; set model.tie_embeddings false, or parallel.pp 1"
        )
    if data_parallel in ("ddp", "zero1") and dp > 1 and pp > 1:
        # torch 2.13: DDP's reducer fails on the pipeline's interleaved micro-batch forwards/backwards ("rebuilt
        # parameter indices size is not same"), and with static_graph=True it averages wrongly. FSDP2 works.
        problems.append(
            f"parallel.data_parallel {data_parallel} (DDP) cannot run inside pipeline stages; with "
            "parallel.pp > 1 use data_parallel fsdp, zero2 or hsdp"
        )
    m = n_microbatches
    if m < 1:
        problems.append(f"the number of pipeline micro-batches must be >= 1, got {m}")
        return problems
    if schedule == "1f1b" and m < pp:
        problems.append(
            f"1f1b needs at least as many micro-batches as stages: {m} < {pp}; set "
            f"parallel.pp_microbatches >= {pp} (bubble (p-1)/(m+p-1) shrinks with more)"
        )
    if schedule in ("interleaved_1f1b", "interleaved_zb"):
        rounds = max(1, m // pp)
        if m % rounds:
            problems.append(
                f"{schedule} runs micro-batches in rounds of pp={pp}: {m} micro-batches is neither a "
                f"multiple of {pp} nor fewer than {pp}; use {rounds * pp} or {(rounds + 1) * pp}"
            )
    if schedule == "dualpipev" and m < 2 * pp:
        problems.append(
            f"dualpipev needs at least as many micro-batches as stages: {m} < {2 * pp}; set "
            f"parallel.pp_microbatches >= {2 * pp}"
        )
    if local_batch is not None and local_batch % m:
        problems.append(
            f"the local batch of {local_batch} sequences does not split into {m} equal micro-batches "
            "(unequal ones would weigh sequences unequally in the mean loss); make the batch a multiple "
            "of parallel.pp_microbatches"
        )
    return problems


def split_model(
    model: Transformer, pp_rank: int, pp_size: int, virtual_stages: int, style: Literal["loop", "v"]
) -> list[tuple[int, Transformer]]:
    """(stage index, module) for each stage `pp_rank` holds. Each module is a copy of `model` (materialised or on
    meta) with only its stage's layers, keyed as in the full model so parameter names and checkpoints match; the first
    stage keeps the embedding, the last the final norm and the output. Parts a stage drops are never copied."""
    n_stages = pp_size * virtual_stages
    if style == "v" and virtual_stages != 2:
        raise ValueError(f"V placement holds exactly 2 stages per rank, got virtual_stages={virtual_stages}")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} is outside a pipeline of {pp_size} ranks")
    n_layers = len(model.layers)
    if n_stages > n_layers:
        raise ValueError(
            f"the model has {n_layers} layers but the pipeline needs {n_stages} stages (pp={pp_size} x "
            f"{virtual_stages} per rank) of at least one layer each; lower parallel.pp or "
            "parallel.pp_virtual_stages, or use more layers"
        )
    if model.args.tie_embeddings and n_stages > 1:
        raise ValueError(
            "tied embeddings cannot be split over pipeline stages; set model.tie_embeddings false"
        )
    counts = layers_per_stage(n_layers, n_stages)
    keys = list(model.layers.keys())
    starts = [sum(counts[:s]) for s in range(n_stages)]
    out = []
    for s in rank_stages(pp_rank, pp_size, virtual_stages, style):
        keep = set(keys[starts[s] : starts[s] + counts[s]])
        first, last = s == 0, s == n_stages - 1
        dropped = [m for k, m in model.layers.items() if k not in keep]
        dropped += [] if first else [model.tok_embeddings]
        dropped += [] if last else [model.norm, model.output]
        # deepcopy's memo maps each dropped module to None: it is skipped, not copied and then thrown away.
        stage = copy.deepcopy(model, {id(m): None for m in dropped if m is not None})
        for k in [k for k in keys if k not in keep]:
            del stage.layers[k]
        if not first:
            stage.tok_embeddings = None
        if not last:
            stage.norm, stage.output = None, None
        out.append((s, stage))
    return out


def build_schedule(
    stages: list[tuple[int, nn.Module]],
    pp_mesh: DeviceMesh,
    schedule_name: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
):
    """Wrap this rank's stage modules in `PipelineStage`s and build the torch schedule; returns (stages, schedule).

    Gradients: each micro-batch's mean loss is divided by the number of micro-batches n *before* its backward, and
    the schedule's own scaling is off (scale_grads=False). Summed over micro-batches this is the gradient of the mean
    loss over the batch (equal micro-batches, see pipeline_problems), computed as StepRunner computes it, with
    `(loss / n).backward()`. The schedule's default (scale_grads=True: backward of the unscaled loss, then divide
    the summed gradients by n) has the same value but rounds differently unless n is a power of two."""
    pp = pp_mesh.size()
    expected = stages_per_rank(schedule_name, len(stages)) if schedule_name in SCHEDULES else len(stages)
    if len(stages) != expected:
        raise ValueError(
            f"{schedule_name} runs {expected} stage(s) per rank, got {len(stages)}; split the model "
            f"with virtual_stages={expected}"
        )
    problems = pipeline_problems(schedule_name, pp, len(stages), n_microbatches)
    if problems:
        raise ValueError("; ".join(problems))
    from torch.distributed import pipelining  # here, not at the top: see SCHEDULES

    num_stages = pp * len(stages)
    group = pp_mesh.get_group()
    pipeline_stages = [
        _stage_class()(module, index, num_stages, device, group=group) for index, module in stages
    ]
    cls = getattr(pipelining, SCHEDULES[schedule_name])
    target = pipeline_stages[0] if schedule_name in SINGLE_STAGE else pipeline_stages
    schedule = cls(
        target,
        n_microbatches=n_microbatches,
        loss_fn=_MicrobatchMean(loss_fn, n_microbatches),
        scale_grads=False,
    )
    return pipeline_stages, schedule


@functools.cache
def _stage_class() -> type[PipelineStage]:
    """A PipelineStage whose shape inference measures nothing: torch runs each stage's forward once on
    uninitialised inputs (torch.empty) to learn the activations' shapes, whose logits QK-clip must not take for the
    step's maxima (torch 2.13 names it _forward_metadata_inference; torchtitan overrides it likewise), and whose
    routing the MoE layers must not count: the first step's load would move the routing biases (moe.bias_update_rate)
    by tokens that do not exist (issue 36: pp 2 left the single process at step 2). Made at first use, as a subclass
    of a class whose module is imported then (see SCHEDULES)."""
    from torch.distributed.pipelining import PipelineStage

    class _Stage(PipelineStage):
        def _forward_metadata_inference(self, *args, **kwargs):
            moe = [m for m in self.submod.modules() if isinstance(m, MoE)]
            held = [[b.clone() for b in m.buffers()] for m in moe]
            with logits_unmeasured(self.submod):
                out = super()._forward_metadata_inference(*args, **kwargs)
            with torch.no_grad():
                for m, saved in zip(moe, held, strict=True):
                    for b, v in zip(m.buffers(), saved, strict=True):
                        b.copy_(v)
            return out

    return _Stage


class _MicrobatchMean:
    """loss_fn(...) / n: one micro-batch's share of the batch's mean loss."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], n: int):
        self.loss_fn, self.n = loss_fn, n

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target) / self.n


def pipeline_step(
    schedule,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    is_first: bool,
    is_last: bool,
    pp_mesh: DeviceMesh,
) -> torch.Tensor:
    """One pipelined forward/backward over this rank's batch (every pp rank passes the same one; only the first stage
    reads the inputs and the last the targets). Returns the mean loss over the batch on every pp rank."""
    n = schedule._n_microbatches  # the schedules expose no public accessor
    if inputs.shape[0] % n:
        raise ValueError(
            f"a batch of {inputs.shape[0]} sequences does not split into {n} equal micro-batches"
        )
    losses: list[torch.Tensor] | None = [] if is_last else None
    # The last stage gets the targets twice: as a forward keyword, so its model computes the summed loss without
    # the whole logits (`Transformer.forward(..., targets=)`, issue 40), and as the schedule's target, from which
    # loss_fn takes the token count.
    schedule.step(
        *((inputs,) if is_first else ()),
        target=targets if is_last else None,
        losses=losses,
        return_outputs=False,
        **({"targets": targets} if is_last else {}),
    )
    loss = torch.zeros((), dtype=torch.float32, device=inputs.device)
    if is_last:
        # The schedule's losses are already divided by n (see build_schedule): their sum is the mean.
        for mb_loss in losses:
            loss += mb_loss.detach()
    # Only the rank that holds the last stage adds a non-zero term (it is rank p-1 looped, rank 0 in a V).
    dist.all_reduce(loss, group=pp_mesh.get_group())
    return loss


def clip_grad_norm_pp(
    parameters: Iterable[nn.Parameter], max_norm: float, pp_mesh: DeviceMesh
) -> torch.Tensor:
    """Global L2 norm of the gradients of every stage, and clip with it. Each rank holds different parameters, so the
    squared local norms are summed over the pp group; clipping with a local norm would scale stages differently."""
    params = [p for p in parameters if p.grad is not None]
    local = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, foreach=True)
    if isinstance(local, DTensor):
        # A TP/FSDP-sharded stage: the norm over the whole (unsharded) stage.
        local = local.full_tensor()
    sq = local.float() ** 2
    dist.all_reduce(sq, group=pp_mesh.get_group())
    total = sq.sqrt()
    if 0 < max_norm < math.inf:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


def ideal_bubble(pp: int, n_microbatches: int, virtual_stages: int = 1) -> float:
    """Idle share of a step with equal stage times: (p-1)/(v·m+p-1) (Narayanan et al. 2021; v=1 for GPipe/1F1B)."""
    return (pp - 1) / (virtual_stages * n_microbatches + pp - 1)


@dataclass
class PipelineParts:
    """This rank's share of the pipeline: its stage modules (in stage order), the torch stages and schedule."""

    modules: nn.ModuleList
    stage_ids: list[int]
    stages: list[PipelineStage]
    schedule: object
    pp_mesh: DeviceMesh
    has_first: bool
    has_last: bool
    n_stages: int
    placement: Literal["loop", "v"]

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return pipeline_step(
            self.schedule,
            inputs,
            targets,
            is_first=self.has_first,
            is_last=self.has_last,
            pp_mesh=self.pp_mesh,
        )

    @torch.no_grad()
    def eval_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Summed loss over the batch's tokens (forward only) and the token count, on every pp rank.

        A forward-only pass of its own rather than `schedule.eval()`: in torch 2.13 the zero-bubble runtime still
        runs its backward actions in eval mode and the V schedules fail at the hand-off between their two local
        stages. Chunks go through the stages GPipe-style; any batch size works (the last chunk may be smaller)."""
        me, group = self.pp_mesh.get_local_rank(), self.pp_mesh.get_group()
        pp = self.pp_mesh.size()
        per_rank = self.n_stages // pp
        owner = {s: r for r in range(pp) for s in rank_stages(r, pp, per_rank, self.placement)}
        modules = dict(zip(self.stage_ids, self.modules))
        total = torch.zeros((), dtype=torch.float32, device=inputs.device)
        chunk = -(-inputs.shape[0] // self.schedule._n_microbatches)
        sends: list = []
        # Each rank works through (chunk, stage) in order with non-blocking sends: every receive waits only on
        # work that comes earlier in that order, so no two ranks wait on each other.
        for x, y in zip(inputs.split(chunk), targets.split(chunk)):
            h = x
            for s in sorted(modules):
                if s > 0 and owner[s - 1] != me:
                    h = _recv_activation(owner[s - 1], group, inputs.device)
                if s == self.n_stages - 1:  # the summed loss, from the targets (no whole logits)
                    total += modules[s](h, targets=y)
                    continue
                h = modules[s](h)
                if owner[s + 1] != me:
                    sends += _send_activation(h, owner[s + 1], group)
        for work, _ in sends:
            work.wait()
        dist.all_reduce(total, group=group)
        return total, targets.numel()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The stages' state merged under the full model's names (stages share no parameter)."""
        out: dict[str, torch.Tensor] = {}
        for m in self.modules:
            out.update(m.state_dict())
        return out


def apply_pp(
    model: Transformer,
    pp_mesh: DeviceMesh,
    *,
    schedule: str,
    n_microbatches: int,
    virtual_stages: int = 2,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_mean,
    parallelize_fn: Callable[[nn.Module], nn.Module] | None = None,
) -> PipelineParts:
    """Split `model` into this rank's stages and build the schedule. `parallelize_fn` (TP, recompute, FSDP) is applied
    to each stage module before it is wrapped, so those run inside a stage; the caller may drop `model` afterwards."""
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    n_layers = len(model.layers)
    problems = pipeline_problems(
        schedule,
        pp,
        virtual_stages,
        n_microbatches,
        n_layers=n_layers,
        tie_embeddings=model.args.tie_embeddings,
    )
    if problems:
        raise ValueError("; ".join(problems))
    v = stages_per_rank(schedule, virtual_stages)
    parts = split_model(model, pp_rank, pp, v, placement_style(schedule))
    if parallelize_fn is not None:
        parts = [(s, parallelize_fn(m)) for s, m in parts]
    stages, sched = build_schedule(parts, pp_mesh, schedule, n_microbatches, loss_fn, device)
    ids = [s for s, _ in parts]
    counts = layers_per_stage(n_layers, pp * v)
    interleaved = (
        f", interleaved (p-1)/(v·m+p-1) = {ideal_bubble(pp, n_microbatches, v):.1%}" if v > 1 else ""
    )
    log.info(
        "applied pipeline %s: pp=%d, %d stage(s) per rank (this rank: %s), layers per stage %s, %d micro-batches, "
        "ideal bubble (p-1)/(m+p-1) = %.1f%%%s",
        schedule,
        pp,
        v,
        ids,
        counts,
        n_microbatches,
        100 * ideal_bubble(pp, n_microbatches),
        interleaved,
    )
    return PipelineParts(
        nn.ModuleList([m for _, m in parts]),
        ids,
        stages,
        sched,
        pp_mesh,
        has_first=0 in ids,
        has_last=pp * v - 1 in ids,
        n_stages=pp * v,
        placement=placement_style(schedule),
    )


# Evaluation's activations carry a header (dtype, rank, shape) so that the receiver needs no shape inference.
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_HEADER = 8


def _send_activation(h: torch.Tensor, dst: int, group) -> list:
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(h.dtype), h.ndim
    header[2 : 2 + h.ndim] = torch.tensor(h.shape)
    header, h = header.to(h.device), h.contiguous()
    # The tensors travel with their works: they must stay alive until the sends complete.
    return [
        (dist.isend(header, group=group, group_dst=dst), header),
        (dist.isend(h, group=group, group_dst=dst), h),
    ]


def _recv_activation(src: int, group, device: torch.device) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=src)
    dtype, ndim = _DTYPES[int(header[0])], int(header[1])
    h = torch.empty(header[2 : 2 + ndim].tolist(), dtype=dtype, device=device)
    dist.recv(h, group=group, group_src=src)
    return h
