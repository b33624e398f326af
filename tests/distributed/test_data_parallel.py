"""Data-parallel layouts (DDP, ZeRO-1, ZeRO-2, FSDP, HSDP) against the single-process reference: same losses, grad
norms and final weights over 10 steps, plus checks that each layout really shards what it promises.

Each spawn runs several layouts of one world size; rank 0 writes what it measured to a JSON file that the
parametrized tests read, so each layout passes or fails on its own."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from scaletrain.config import ParallelConfig
from scaletrain.optim import build_lr_scheduler, build_optimizer
from scaletrain.parallel.data_parallel import build_zero1_optimizer, full_state_dict
from scaletrain.parallel.mesh import ParallelDims, all_reduce_mean
from scaletrain.parallel.parallelize import parallelize
from scaletrain.parallel.tensor_parallel import loss_context
from scaletrain.step import StepRunner
from tests.distributed.reference import (
    OPT,
    assert_close_run,
    full_model,
    global_batches,
    reference_run,
    tiny_args,
)
from tests.distributed.spawn import spawn

CPU = torch.device("cpu")
# Final weights: the reference run itself, with its micro-batches merely split 2 instead of 4 per step, moves one
# weight by 1.2e-5 (AdamW divides by sqrt(v): a rounding difference in a near-zero gradient becomes a visible
# update difference). Any layout reorders sums like that, so weights are held to 2e-5; losses and grad norms to
# the design's relative 1e-5.
PARAM_ATOL = 2e-5


def _facts(model: nn.Module, optimizer) -> dict:
    """What the layout did to the model, for the tests to check it shards what it promises."""
    inner = model.module if isinstance(model, DDP) else model
    wq = inner.layers["0"].attention.wq.weight
    sharded = isinstance(wq, DTensor)
    facts = {
        "ddp": isinstance(model, DDP),
        "dtensor": sharded,
        "mesh": wq.device_mesh.ndim if sharded else 0,
        "wq_local_numel": (wq.to_local() if sharded else wq).numel(),
        "wq_numel": wq.numel(),
        "placements": [repr(p) for p in wq.placements] if sharded else [],
        "norm_dtensor": isinstance(inner.layers["0"].attention_norm.weight, DTensor),
    }
    local = getattr(
        optimizer, "optim", optimizer
    )  # ZeroRedundancyOptimizer keeps its shard's AdamW in .optim
    facts["opt_local_numel"] = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel()
        for g in local.param_groups
        for p in g["params"]
    )
    facts["numel"] = sum(p.numel() for p in inner.parameters())
    return facts


def _watch(model: nn.Module) -> dict:
    """Record during training (1) whether, when block 1 runs forward, block 0's weights are still gathered (plain
    tensors: ZeRO-2 keeps them until backward) or already resharded (DTensors: FSDP frees them after forward), and
    (2) the layout of the residual stream entering block 0 (sequence parallel shards it on the sequence)."""
    inner = model.module if isinstance(model, DDP) else model
    seen = {"kept_gathered": False, "block_input": "plain"}

    def before_block1(mod, args):
        if torch.is_grad_enabled() and not isinstance(inner.layers["0"].attention.wq.weight, DTensor):
            seen["kept_gathered"] = True

    def before_block0(mod, args):
        if isinstance(args[0], DTensor):
            seen["block_input"] = repr(args[0].placements)

    inner.layers["1"].register_forward_pre_hook(before_block1)
    inner.layers["0"].register_forward_pre_hook(before_block0)
    return seen


def _train_layout(pcfg: ParallelConfig, world_size: int, args, batches) -> dict:
    """Train as train.py does: parallelize the fully materialised model, then StepRunner steps."""
    dims = ParallelDims.from_config(pcfg, world_size)
    dims.build_mesh("cpu")
    pm = parallelize(full_model(args), dims, pcfg, device=CPU, n_microbatches=2)
    (model,) = pm.parts
    if pcfg.data_parallel == "zero1":
        opt = build_zero1_optimizer(model, OPT, CPU, dims.submesh("dp_cp"))
    else:
        opt = build_optimizer(model, OPT, CPU)
    sched = build_lr_scheduler(opt, OPT, len(batches))
    seen = _watch(model)
    # Each data-parallel rank takes its contiguous slice of the global batch, in two micro-batches.
    local = batches[0][0].shape[0] // dims.dp_size
    rows = slice(dims.dp_rank * local, (dims.dp_rank + 1) * local)
    runner = StepRunner(
        pm.parts,
        local // 2,
        contextlib.nullcontext(),
        grad_clip=1.0,
        loss_context=lambda: loss_context(pm.loss_parallel),
    )
    losses, norms = [], []
    for x, y in batches:
        loss = runner.forward_backward(x[rows], y[rows])
        norms.append(runner.clip().item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(all_reduce_mean(loss, dims.submesh("dp_cp")).item())
    facts = {**_facts(model, opt), **seen}
    return {"losses": losses, "norms": norms, "state": full_state_dict(model), "facts": facts}


def layouts_worker(rank: int, world_size: int, layouts: dict[str, dict], out: str) -> None:
    """Train every layout of `layouts` (name -> ParallelConfig fields) and compare it with the reference."""
    args = tiny_args()
    batches = global_batches(args)
    ref = reference_run(full_model(args), batches)
    results = {}
    for name, fields in layouts.items():
        got = _train_layout(ParallelConfig(**fields), world_size, args, batches)
        error = None
        try:
            assert_close_run(
                got["losses"], got["norms"], got["state"], ref, rtol=1e-5, atol_params=PARAM_ATOL
            )
        except AssertionError as e:
            error = f"rank {rank}: {e}"
        errors = [None] * world_size
        dist.all_gather_object(errors, error)
        results[name] = {
            "error": next((e for e in errors if e), None),
            "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])),
            "norm_rel": max(abs(a - b) / abs(b) for a, b in zip(got["norms"], ref["grad_norms"])),
            "param_abs": max((got["state"][k] - v).abs().max().item() for k, v in ref["state"].items()),
            "facts": got["facts"],
        }
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def run_layouts(tmp_path_factory, world_size: int, layouts: dict[str, dict]) -> dict:
    out = tmp_path_factory.mktemp(f"layouts{world_size}") / "results.json"
    spawn(layouts_worker, world_size, layouts, str(out))
    with open(out) as f:
        return json.load(f)


def check_equivalent(results: dict, name: str) -> dict:
    r = results[name]
    print(
        f"{name}: max relative diff loss {r['loss_rel']:.1e}, grad norm {r['norm_rel']:.1e}; "
        f"max abs param diff {r['param_abs']:.1e}"
    )
    assert r["error"] is None, r["error"]
    return r["facts"]


LAYOUTS_2 = {
    "ddp": dict(data_parallel="ddp"),
    "zero1": dict(data_parallel="zero1"),
    "zero2": dict(data_parallel="zero2"),
    "fsdp": dict(data_parallel="fsdp"),
}
LAYOUTS_4 = {
    "fsdp": dict(data_parallel="fsdp"),
    "hsdp": dict(data_parallel="hsdp", dp_replicate=2, dp_shard=2),
}


@pytest.fixture(scope="module")
def results_2(tmp_path_factory):
    return run_layouts(tmp_path_factory, 2, LAYOUTS_2)


@pytest.fixture(scope="module")
def results_4(tmp_path_factory):
    return run_layouts(tmp_path_factory, 4, LAYOUTS_4)


def test_ddp_matches_reference(results_2):
    facts = check_equivalent(results_2, "ddp")
    assert facts["ddp"] and not facts["dtensor"]
    assert facts["opt_local_numel"] == facts["numel"]


def test_zero1_matches_reference_and_shards_optimizer_state(results_2):
    facts = check_equivalent(results_2, "zero1")
    assert facts["ddp"]
    # Parameters are split whole between ranks, greedily by size: about half each.
    assert 0.3 * facts["numel"] < facts["opt_local_numel"] < 0.7 * facts["numel"]


@pytest.mark.parametrize("mode", ["zero2", "fsdp"])
def test_sharded_data_parallel_matches_reference(results_2, mode):
    facts = check_equivalent(results_2, mode)
    assert facts["dtensor"] and facts["placements"] == [repr(Shard(0))]
    assert facts["wq_local_numel"] * 2 == facts["wq_numel"]
    assert facts["opt_local_numel"] * 2 == facts["numel"]
    # ZeRO-2 keeps a block's gathered weights from its forward to its backward; FSDP frees them after forward.
    assert facts["kept_gathered"] == (mode == "zero2")


def test_fsdp_4_matches_reference(results_4):
    facts = check_equivalent(results_4, "fsdp")
    assert facts["wq_local_numel"] * 4 == facts["wq_numel"]


def test_hsdp_2x2_matches_reference(results_4):
    facts = check_equivalent(results_4, "hsdp")
    # Replicated across the 2 groups, sharded in 2 within each.
    assert facts["placements"] == [repr(Replicate()), repr(Shard(0))]
    assert facts["wq_local_numel"] * 2 == facts["wq_numel"]
