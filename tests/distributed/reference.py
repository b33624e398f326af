"""The one harness of the parallel equivalence tests (llm.c's habit: one reference run, everything else checked
against it). `train_steps` trains any layout as train.py does — with its `build_core` —
and the single-process reference is the same call on one process. `run_layouts` trains named cases in N gloo
processes and summarises each against its reference; `check_equivalent` is what a test asserts on that summary."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from scaletrain.checkpoint.state import ModelState
from scaletrain.config import MemoryConfig, OptimizerConfig, ParallelConfig, TrainingConfig
from scaletrain.data.ramp import BatchRamp
from scaletrain.job import build_core
from scaletrain.models import ModelArgs, Transformer, build_model
from scaletrain.optim.optimizers import Optimizers
from scaletrain.parallel.data_parallel import full_state_dict
from scaletrain.parallel.mesh import ParallelDims, all_reduce_mean
from scaletrain.parallel.parallelize import ParallelModel
from scaletrain.parallel.step import StepRunner
from tests.distributed.spawn import spawn

CPU = torch.device("cpu")
OPT = OptimizerConfig(lr=3e-3, warmup_steps=2, schedule="cosine", weight_decay=0.1)
STEPS = 10
# Final weights of the data- and tensor-parallel layouts: the reference run itself, with its micro-batches merely
# split 2 instead of 4 per step, moves one weight by 1.2e-5 (AdamW divides by sqrt(v): a rounding difference in a
# near-zero gradient becomes a visible update difference). Any layout reorders sums like that, so their weights
# are held to 2e-5; losses and grad norms to the design's relative 1e-5.
PARAM_ATOL = 2e-5


def tiny_args(**kw) -> ModelArgs:
    base = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=128, max_seq_len=32)
    return ModelArgs(**{**base, **kw})


def full_model(args: ModelArgs, seed: int = 0) -> Transformer:
    """The model materialised on CPU with a fixed seed: the same weights on every rank and in every layout."""
    return build_model(args, seed, CPU)


def global_batches(args: ModelArgs, global_batch: int = 8, steps: int = STEPS, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, args.vocab_size, (global_batch, args.max_seq_len + 1), generator=g)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


@dataclass
class Run:
    """What `train_steps` measured, and the trained objects for a caller's own checks afterwards."""

    losses: list[float]  # the mean loss over the global batch at each step
    grad_norms: list[float]  # the global gradient norm before clipping at each step
    state: dict[str, torch.Tensor]  # every parameter whole, under the full model's names, on every rank
    replica_mismatches: list[str]  # what differs between data-parallel ranks (see replica_mismatches)
    pm: ParallelModel
    dims: ParallelDims
    runner: StepRunner
    optimizers: Optimizers


def unwrap(part: nn.Module) -> nn.Module:
    return part.module if isinstance(part, DDP) else part


def train_steps(
    model: Transformer,
    dims: ParallelDims,
    pcfg: ParallelConfig,
    batches: list,
    tcfg: TrainingConfig,
    *,
    opt_cfg: OptimizerConfig = OPT,
    n_microbatches: int = 1,
    after_backward: Callable[[int, ParallelModel], None] | None = None,
    memory: MemoryConfig | None = None,
    ramp: BatchRamp | None = None,
    first: int = 0,
    load: str = "",
    save: str = "",
    routing_bias_rate: float = 0.0,
) -> Run:
    """Train `model` (consumed) on the global `batches` in the layout `pcfg`, as train.py does.

    Each data-parallel rank takes its contiguous slice of every global batch; its tp, cp and pp peers take the same
    slice (StepRunner shards it over cp; only the pipeline's first stage reads inputs and its last the targets).
    `after_backward(step, pm)` runs after each step's backward, before clipping (step counts from 0). `memory`
    (recompute, offload) and `ramp` (training.batch_ramp, whose steps' batches differ in size) are handed to
    build_core as train.py does; default off. A resume: a DCP checkpoint of the model and optimizer (as train.py
    saves them) is loaded from `load` first and only batches[first:] are trained, of a schedule still len(batches)
    long; `save`: one is saved there before step len(batches) // 2. `routing_bias_rate`: moe.bias_update_rate."""
    if dims.mesh is None and dims.world_size > 1:
        dims.build_mesh("cpu")
    pm, optimizers, runner = build_core(model, dims, pcfg, replace(tcfg, steps=len(batches)), opt_cfg, device=CPU,
                                        n_microbatches=n_microbatches, memory=memory, ramp=ramp,
                                        routing_bias_rate=routing_bias_rate)  # fmt: skip
    state = {"model": ModelState(pm.parts), "optimizer": optimizers}
    if load:
        dcp.load(state, checkpoint_id=load)
    losses, norms = [], []
    for step in range(first, len(batches)):
        if save and step == len(batches) // 2:
            dcp.save(state, checkpoint_id=save)
        x, y = batches[step]
        local = len(x) // dims.dp_size
        rows = slice(dims.dp_rank * local, (dims.dp_rank + 1) * local)
        loss = runner.forward_backward(x[rows], y[rows])
        if after_backward is not None:
            after_backward(step, pm)
        norms.append(runner.clip().item())
        optimizers.step()
        losses.append(all_reduce_mean(loss, dims.submesh("dp_cp")).item())
    return Run(
        losses,
        norms,
        gather_state(pm, dims),
        replica_mismatches(pm.parts, dims),
        pm,
        dims,
        runner,
        optimizers,
    )


def gather_state(pm: ParallelModel, dims: ParallelDims) -> dict[str, torch.Tensor]:
    """Every parameter whole on every rank: DTensors gathered (`full_tensor()`), pipeline stages merged by name
    over the pp group (no two stages may hold the same parameter). A collective."""
    state: dict[str, torch.Tensor] = {}
    for part in pm.parts:
        state.update({k: v.clone() for k, v in full_state_dict(part).items()})  # copies, not live weights
    if not dims.pp_enabled:
        return state
    every: list = [None] * dims.pp
    dist.all_gather_object(every, state, group=dims.submesh("pp").get_group())
    merged: dict[str, torch.Tensor] = {}
    for s in every:
        assert not merged.keys() & s.keys(), f"two pipeline ranks hold {sorted(merged.keys() & s.keys())}"
        merged.update(s)
    return merged


def _differs(t: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """Whether the bits of `t` differ on any rank of `group` (every rank gets the same answer)."""
    bits = t.detach().contiguous().view(-1).view(torch.uint8)
    every = [torch.empty_like(bits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, bits, group=group)
    return not all(torch.equal(bits, other) for other in every)


def replica_mismatches(parts: list[nn.Module], dims: ParallelDims) -> list[str]:
    """nanotron's replica check: the parameters data parallelism replicates are the same on every dp rank.

    Bitwise: a plain parameter (DDP, ZeRO-1, or cp ranks, which hold whole replicas too) across the dp_cp group,
    and a DTensor's local shard across each data-parallel mesh dim it is replicated on (HSDP's dp_replicate).
    A sharded parameter (FSDP, TP) is compared gathered, its full tensor across the dp_cp group. Returns
    "name: where" for each difference; [] when data parallelism is off. A collective over the dp_cp group."""
    mesh = dims.submesh("dp_cp")
    if mesh is None or mesh.size() == 1:
        return []
    group, bad = mesh.get_group(), []
    for part in parts:
        for name, p in unwrap(part).named_parameters():
            if isinstance(p, DTensor):
                for i, placement in enumerate(p.placements):
                    dim = p.device_mesh.mesh_dim_names[i]
                    if placement.is_replicate() and dim.startswith("dp") and p.device_mesh.size(i) > 1:
                        if _differs(p.to_local(), p.device_mesh.get_group(i)):
                            bad.append(f"{name}: local shard across {dim}")
                full = p.full_tensor()
            else:
                full = p
            if _differs(full, group):
                bad.append(f"{name}: {'full tensor' if isinstance(p, DTensor) else 'value'} across dp_cp")
    return bad


def reference_run(
    model: Transformer,
    batches: list,
    micro_batch: int = 4,
    grad_clip: float = 1.0,
    after_backward: Callable[[int, ParallelModel], None] | None = None,
    routing_bias_rate: float = 0.0,
) -> Run:
    """Train a copy of `model` on one process (the same StepRunner and Optimizers, no mesh): the reference."""
    pcfg = ParallelConfig()
    return train_steps(
        copy.deepcopy(model),
        ParallelDims.from_config(pcfg, 1),
        pcfg,
        batches,
        TrainingConfig(micro_batch=micro_batch, grad_clip=grad_clip),
        after_backward=after_backward,
        routing_bias_rate=routing_bias_rate,
    )


def assert_close_run(got: Run, ref: Run, rtol: float = 1e-5, atol_params: float = 1e-5) -> None:
    """Losses and grad norms within rtol of the reference at every step; the same parameters, each within
    atol_params of the reference's final value."""
    assert len(got.losses) == len(ref.losses) == len(got.grad_norms)
    for i, (a, b) in enumerate(zip(got.losses, ref.losses)):
        assert abs(a - b) <= rtol * abs(b), f"step {i + 1}: loss {a} vs reference {b}"
    for i, (a, b) in enumerate(zip(got.grad_norms, ref.grad_norms)):
        assert abs(a - b) <= rtol * abs(b), f"step {i + 1}: grad norm {a} vs reference {b}"
    assert set(got.state) == set(ref.state), (
        f"parameters missing {sorted(set(ref.state) - set(got.state))}, "
        f"unexpected {sorted(set(got.state) - set(ref.state))}"
    )
    for k, v in ref.state.items():
        torch.testing.assert_close(got.state[k], v, rtol=0, atol=atol_params, msg=lambda m, k=k: f"{k}: {m}")


def _diffs(got: Run, ref: Run) -> dict[str, float]:
    """The largest differences from the reference, for the record (printed by check_equivalent)."""
    rel = lambda a, b: max(abs(x - y) / abs(y) for x, y in zip(a, b))  # noqa: E731
    common = ref.state.keys() & got.state.keys()
    return {
        "loss_rel": rel(got.losses, ref.losses),
        "norm_rel": rel(got.grad_norms, ref.grad_norms),
        "param_abs": max((got.state[k] - ref.state[k]).abs().max().item() for k in common),
    }


# -- Many cases in one spawn ----------------------------------------------------------------------------------
#
# A case function `case(rank, world_size, spec) -> dict` runs on every rank and returns "facts" (JSON values the
# tests check), optionally "run" and "ref" (Runs to compare, within "rtol" if given), and "errors" (messages of
# checks that failed). It
# must not raise between collectives (the other ranks would wait for it): failures are returned, not raised.


def layouts_worker(
    rank: int, world_size: int, case: Callable, cases: dict, out: str, rtol: float, atol_params: float
) -> None:
    results = {}
    for name, spec in cases.items():
        got = case(rank, world_size, spec)
        errors, diffs = list(got.get("errors", [])), {}
        if "run" in got:
            try:
                # A case may widen rtol for itself (with the reason where it does so).
                assert_close_run(got["run"], got["ref"], rtol=got.get("rtol", rtol), atol_params=atol_params)
            except AssertionError as e:
                errors.append(str(e))
            diffs = _diffs(got["run"], got["ref"])
        mine = {
            "errors": [f"rank {rank}: {e}" for e in errors],
            "diffs": diffs,
            "replica_mismatches": got["run"].replica_mismatches if "run" in got else [],
            "facts": got.get("facts", {}),
        }
        every: list = [None] * world_size
        dist.all_gather_object(every, mine)
        results[name] = {
            "errors": [e for r in every for e in r["errors"]],
            "diffs": {k: max(r["diffs"][k] for r in every) for k in mine["diffs"]},
            "replica_mismatches": sorted({m for r in every for m in r["replica_mismatches"]}),
            "facts": [r["facts"] for r in every],
        }
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def run_layouts(
    tmp_path_factory,
    world_size: int,
    cases: dict,
    case: Callable | None = None,
    *,
    rtol: float = 1e-5,
    atol_params: float = 1e-5,
) -> dict:
    """Run every case of `cases` (name -> spec) in one spawn of `world_size` gloo processes; `case` defaults to
    `layout_case` (spec: ParallelConfig fields). Returns the summaries by name, for `check_equivalent`."""
    out = tmp_path_factory.mktemp(f"layouts{world_size}") / "results.json"
    spawn(layouts_worker, world_size, case or layout_case, cases, str(out), rtol, atol_params)
    with open(out) as f:
        return json.load(f)


def check_equivalent(results: dict, name: str) -> list[dict]:
    """Assert that case `name` matched its reference and kept its data-parallel replicas identical; returns
    each rank's facts, by rank."""
    r = results[name]
    if r["diffs"]:
        d = r["diffs"]
        print(
            f"{name}: max relative diff loss {d['loss_rel']:.1e}, grad norm {d['norm_rel']:.1e}; "
            f"max abs param diff {d['param_abs']:.1e}"
        )
    assert not r["errors"], "\n".join(r["errors"])
    assert not r["replica_mismatches"], f"replicas differ across dp ranks: {r['replica_mismatches']}"
    return r["facts"]


# -- The layout case of the data, tensor and context parallel tests --------------------------------------------

_REFERENCES: dict[tuple, Run] = {}


def reference_for(args: ModelArgs, global_batch: int = 8, micro_batch: int = 4) -> Run:
    """The reference of `tiny_args` layouts, computed once per process (every layout of a spawn shares it)."""
    key = (repr(args), global_batch, micro_batch)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_run(full_model(args), global_batches(args, global_batch), micro_batch)
    return _REFERENCES[key]


def layout_case(rank: int, world_size: int, fields: dict) -> dict:
    """Train the tiny model in the layout `fields` (ParallelConfig fields; "micro_batch" is the step's, by
    default half the local batch) and record what the layout did to the model, for the tests to check that it
    shards what it promises."""
    fields = dict(fields)
    args = tiny_args()
    batches = global_batches(args)
    pcfg = ParallelConfig(**{k: v for k, v in fields.items() if k != "micro_batch"})
    dims = ParallelDims.from_config(pcfg, world_size)
    local = batches[0][0].shape[0] // dims.dp_size
    model = full_model(args)
    seen = _watch(model)
    run = train_steps(
        model, dims, pcfg, batches, TrainingConfig(micro_batch=fields.get("micro_batch", local // 2))
    )
    facts = {**_facts(run), **seen, "replica_check_catches": _replica_check_catches(run)}
    return {"run": run, "ref": reference_for(args), "facts": facts}


def _facts(run: Run) -> dict:
    (part,) = run.pm.parts
    inner = unwrap(part)
    wq = inner.layers["0"].attention.wq.weight
    sharded = isinstance(wq, DTensor)
    # ZeroRedundancyOptimizer keeps its shard's AdamW in .optim.
    local_opt = getattr(run.optimizers.optimizers[0], "optim", run.optimizers.optimizers[0])
    return {
        "ddp": isinstance(part, DDP),
        "dtensor": sharded,
        "mesh": wq.device_mesh.ndim if sharded else 0,
        "wq_local_numel": (wq.to_local() if sharded else wq).numel(),
        "wq_numel": wq.numel(),
        "placements": [repr(p) for p in wq.placements] if sharded else [],
        "norm_dtensor": isinstance(inner.layers["0"].attention_norm.weight, DTensor),
        "attention": type(inner.layers["0"].attention.sdpa).__name__,
        "opt_local_numel": sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel()
            for g in local_opt.param_groups
            for p in g["params"]
        ),
        "numel": sum(p.numel() for p in inner.parameters()),
        "comm_bytes": run.pm.comm.total / len(run.losses),  # data-parallel bytes per step (parallel/comm.py)
    }


def _watch(model: Transformer) -> dict:
    """Record during training (1) whether, when block 1 runs forward, block 0's weights are still gathered (plain
    tensors: ZeRO-2 keeps them until backward) or already resharded (DTensors: FSDP frees them after forward),
    (2) the layout and local length of the residual stream entering block 0 (sequence parallel shards it on the
    sequence, context parallel splits the sequence), and (3) the token positions the model is called with."""
    seen = {"kept_gathered": False, "block_input": "plain", "block_input_len": None, "positions": None}

    def before_model(mod, args, kwargs):
        if seen["positions"] is None and kwargs.get("positions") is not None:
            seen["positions"] = kwargs["positions"].tolist()

    def before_block1(mod, args):
        if torch.is_grad_enabled() and not isinstance(model.layers["0"].attention.wq.weight, DTensor):
            seen["kept_gathered"] = True

    def before_block0(mod, args):
        h = args[0]
        if isinstance(h, DTensor):
            seen["block_input"] = repr(h.placements)
            h = h.to_local()
        seen["block_input_len"] = h.shape[1]

    model.register_forward_pre_hook(before_model, with_kwargs=True)
    model.layers["1"].register_forward_pre_hook(before_block1)
    model.layers["0"].register_forward_pre_hook(before_block0)
    return seen


def _replica_check_catches(run: Run) -> bool | None:
    """Whether the replica check sees one ulp of one weight changed on the last dp rank: True for a layout that
    replicates that weight bitwise (DDP, ZeRO-1, HSDP's replicas), None for one that does not (nothing to see).
    The weight is restored afterwards. A collective over the dp_cp group."""
    mesh = run.dims.submesh("dp_cp")
    if mesh is None or mesh.size() == 1:
        return None
    name = "layers.0.attention.wq.weight"
    p = unwrap(run.pm.parts[0]).get_parameter(name)
    if isinstance(p, DTensor):
        names = zip(p.device_mesh.mesh_dim_names, p.placements, strict=True)
        if not any(pl.is_replicate() and n.startswith("dp") for n, pl in names):
            return None
    with torch.no_grad():
        local = (p.to_local() if isinstance(p, DTensor) else p).view(-1)
        saved = local[0].clone()
        if mesh.get_local_rank() == mesh.size() - 1:
            local[0] = torch.nextafter(saved, torch.tensor(float("inf")))
        flagged = replica_mismatches(run.pm.parts, run.dims)
        local[0] = saved
    return any(m.startswith(name + ":") for m in flagged)
