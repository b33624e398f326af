"""Data-parallel communication (scaletrain/parallel/comm.py) on 2 and 4 gloo processes: DDP's bf16/fp16 and
PowerSGD hooks train within a stated tolerance of plain DDP and cut the counted bytes by the expected factor,
PowerSGD's state resumes bit for bit through a DCP checkpoint, and FSDP2's prefetch and int reshard train the
same model as the single-process run while their counted all-gather bytes are exactly what the layout implies."""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

from scaletrain.checkpoint import ModelState
from scaletrain.config import ParallelConfig, TrainingConfig
from scaletrain.optim import Optimizers
from scaletrain.parallel.data_parallel import optimizer_builder
from scaletrain.parallel.mesh import ParallelDims, all_reduce_mean
from scaletrain.parallel.parallelize import parallelize
from scaletrain.step import build_step_runner
from tests.distributed.reference import (
    CPU,
    OPT,
    STEPS,
    check_equivalent,
    full_model,
    global_batches,
    layout_case,
    run_layouts,
    tiny_args,
    train_steps,
)

START = 2  # PowerSGD's plain all-reduce steps (powersgd_start_iter)
RANK = 2  # PowerSGD's approximation rank
# bf16/fp16 all-reduce: each gradient rounded to 8/11 mantissa bits before averaging; 10 steps of the tiny model
# stay within this relative loss difference of fp32 DDP (measured: see the test's printout).
HALF_RTOL = 5e-3
# PowerSGD rank 2 replaces each gradient matrix by a rank-2 approximation (with error feedback); over 10 steps
# of the tiny model its losses stay within this relative difference of fp32 DDP.
POWERSGD_RTOL = 3e-2


def _bytes_per_step(pcfg: ParallelConfig, world_size: int) -> dict:
    """Train the tiny model under `pcfg` (as train.py does); its losses and counted bytes per step."""
    per_step, last = [], [0.0]

    def after_backward(step, pm):
        per_step.append(pm.comm.total - last[0])
        last[0] = pm.comm.total

    args = tiny_args()
    dims = ParallelDims.from_config(pcfg, world_size)
    run = train_steps(full_model(args), dims, pcfg, global_batches(args), TrainingConfig(micro_batch=2),
                      after_backward=after_backward)  # fmt: skip
    return {"losses": run.losses, "bytes": per_step}


def hooks_case(rank: int, world_size: int, spec: dict) -> dict:
    if spec.get("resume"):
        return {"facts": _resume_facts(world_size)}
    return {"facts": _bytes_per_step(ParallelConfig(**spec), world_size)}


def _build(pcfg: ParallelConfig, world_size: int):
    args = tiny_args()
    dims = ParallelDims.from_config(pcfg, world_size)
    dims.build_mesh("cpu")
    pm = parallelize(full_model(args), dims, pcfg, device=CPU, n_microbatches=1)
    optimizers = Optimizers(pm.parts, optimizer_builder(OPT, "ddp", dims.submesh("dp_cp"), CPU), OPT, STEPS)
    runner = build_step_runner(pm, dims, pcfg, TrainingConfig(micro_batch=2), CPU)
    return dims, pm, optimizers, runner


def _steps(dims, pm, optimizers, runner, batches) -> list[float]:
    local = batches[0][0].shape[0] // dims.dp_size
    rows = slice(dims.dp_rank * local, (dims.dp_rank + 1) * local)
    losses = []
    for x, y in batches:
        loss = runner.forward_backward(x[rows], y[rows])
        runner.clip()
        optimizers.step()
        losses.append(all_reduce_mean(loss, dims.submesh("dp_cp")).item())
    return losses


def _resume_facts(world_size: int) -> dict:
    """10 steps straight, against 5 steps, a DCP checkpoint of model + optimizer + PowerSGD state, and 5 more
    steps in freshly built objects (whose DDP starts again from its initial buckets)."""
    pcfg = ParallelConfig(grad_compression="powersgd", powersgd_rank=RANK, powersgd_start_iter=START)
    batches = global_batches(tiny_args())
    straight = _steps(*_build(pcfg, world_size), batches)
    dims, pm, optimizers, runner = _build(pcfg, world_size)
    first = _steps(dims, pm, optimizers, runner, batches[:5])
    path = [tempfile.mkdtemp(prefix="powersgd-") if dims.dp_rank == 0 else None]
    torch.distributed.broadcast_object_list(path, group=dims.control)
    state = {"model": ModelState(pm.parts), "optimizer": optimizers, "comm": pm.comm}
    dcp.save(state, checkpoint_id=path[0], process_group=dims.control)
    saved_iter = pm.comm.powersgd.state.iter
    dims, pm, optimizers, runner = _build(pcfg, world_size)
    state = {"model": ModelState(pm.parts), "optimizer": optimizers, "comm": pm.comm}
    dcp.load(state, checkpoint_id=path[0], process_group=dims.control)
    resumed = _steps(dims, pm, optimizers, runner, batches[5:])
    return {"straight": straight, "resumed": first + resumed, "saved_iter": saved_iter}


@pytest.fixture(scope="module")
def hooks(tmp_path_factory):
    cases = {
        "none": dict(),
        "bf16": dict(grad_compression="bf16"),
        "fp16": dict(grad_compression="fp16"),
        "powersgd": dict(grad_compression="powersgd", powersgd_rank=RANK, powersgd_start_iter=START),
        "resume": dict(resume=True),
    }
    return {k: v["facts"] for k, v in run_layouts(tmp_path_factory, 2, cases, hooks_case).items()}


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _params() -> list[torch.Size]:
    return [p.shape for p in full_model(tiny_args()).parameters()]


def test_half_precision_hooks_halve_the_bytes_and_follow_fp32(hooks):
    plain = hooks["none"][0]
    grads = sum(math.prod(s) for s in _params()) * 4  # fp32; a 2-rank ring all-reduce sends 2(W-1)/W = 1 x
    assert plain["bytes"] == [grads] * STEPS
    for kind in ("bf16", "fp16"):
        got = hooks[kind][0]
        assert got["bytes"] == [grads / 2] * STEPS, kind
        print(
            f"{kind}: max relative loss difference from fp32 DDP {_rel(got['losses'], plain['losses']):.1e}"
        )
        assert _rel(got["losses"], plain["losses"]) < HALF_RTOL
        assert got["losses"] != plain["losses"]  # the hook did run: rounding shows


def test_powersgd_bytes_fall_by_the_low_rank_factor_and_it_trains(hooks):
    plain, got = hooks["none"][0], hooks["powersgd"][0]
    expected = 0
    for shape in _params():  # torch's rule: compress when (n + m) r x 2 < n m (min_compression_rate 2)
        n, m = shape[0], math.prod(shape) // shape[0]
        r = min(n, m, RANK)
        expected += (n + m) * r if (n + m) * r * 2 < n * m else n * m
    assert got["bytes"][:START] == plain["bytes"][:START]  # plain all-reduce first
    assert got["bytes"][START:] == [expected * 4] * (STEPS - START)
    print(f"PowerSGD rank {RANK}: {expected * 4} of {plain['bytes'][0]:.0f} bytes per step")
    assert expected * 4 < plain["bytes"][0] / 5
    print(f"powersgd: max relative loss difference from fp32 DDP {_rel(got['losses'], plain['losses']):.1e}")
    assert _rel(got["losses"], plain["losses"]) < POWERSGD_RTOL
    assert got["losses"][:START] == plain["losses"][:START]


def test_powersgd_state_resumes_bit_for_bit(hooks):
    for facts in hooks["resume"]:
        assert facts["saved_iter"] == 5  # the state was live (compressing since step 3) when saved
        assert facts["resumed"] == facts["straight"]


# -- FSDP2: prefetch and reshard_after_forward -----------------------------------------------------------------


def fsdp_case(rank: int, world_size: int, spec: dict) -> dict:
    got = layout_case(rank, world_size, spec)
    got["facts"]["comm_bytes"] = got["run"].pm.comm.total / STEPS
    return got


FSDP = {
    "reshard": dict(data_parallel="fsdp"),
    "keep": dict(data_parallel="fsdp", reshard_after_forward=False),
    "reshard_2_prefetch_2": dict(data_parallel="fsdp", reshard_after_forward=2, fsdp_prefetch=2),
}


def test_fsdp_prefetch_and_int_reshard_match_reference_and_count_gathers(tmp_path_factory):
    results = run_layouts(tmp_path_factory, 4, FSDP, fsdp_case)
    model = full_model(tiny_args())
    total = sum(p.numel() for p in model.parameters()) * 4
    blocks = [sum(p.numel() for p in b.parameters()) * 4 for b in model.layers.values()]
    resharded = sum(blocks[:-1])  # the last block and the root stay gathered into backward
    micro = 2  # layout_case: the local batch of 2 in micro-batches of 1
    # Per step: each micro-batch's forward all-gathers everything (3/4 of it sent by each of 4 ranks), each
    # backward re-gathers what was resharded, one reduce-scatter of every gradient (grad_sync = step).
    expected = {
        "reshard": micro * 0.75 * (total + resharded) + 0.75 * total,
        "keep": micro * 0.75 * total + 0.75 * total,
        "reshard_2_prefetch_2": micro * (0.75 * total + 0.5 * resharded) + 0.75 * total,  # re-gather in pairs
    }
    for name in FSDP:
        every = check_equivalent(results, name)
        assert [f["comm_bytes"] for f in every] == [expected[name]] * 4, name
