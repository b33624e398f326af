"""Data-parallel communication (scaletrain/parallel/comm.py) on 2 and 4 gloo processes: DDP's bf16/fp16 and
PowerSGD hooks train within a stated tolerance of plain DDP and cut the counted bytes by the expected factor,
PowerSGD's state resumes bit for bit through a DCP checkpoint, and FSDP2's prefetch and int reshard train the
same model as the single-process run while their counted all-gather bytes are exactly what the layout implies
(the int reshard_after_forward, which needs 4 ranks, is in test_data_parallel.py's 4-rank spawn)."""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

from scaletrain.checkpoint import ModelState
from scaletrain.config import ParallelConfig, TrainingConfig
from scaletrain.job import build_core
from scaletrain.models import ModelArgs
from scaletrain.parallel.mesh import ParallelDims, all_reduce_mean
from tests.distributed.reference import (
    CPU,
    OPT,
    PARAM_ATOL,
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
HALF_RTOL = 1e-3
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


def comm_case(rank: int, world_size: int, spec: dict) -> dict:
    """A DDP hook case (its losses and bytes per step), the PowerSGD resume, or an FSDP layout case (held to the
    reference by check_equivalent) with its mean bytes per step."""
    spec = dict(spec)
    if resume := spec.pop("resume", None):
        return {"facts": _resume_facts(world_size, **resume)}
    if spec.get("data_parallel") == "fsdp":
        got = layout_case(rank, world_size, spec)
        got["facts"]["comm_bytes"] = got["run"].pm.comm.total / STEPS
        return got
    return {"facts": _bytes_per_step(ParallelConfig(**spec), world_size)}


def _build(pcfg: ParallelConfig, world_size: int, args: ModelArgs):
    dims = ParallelDims.from_config(pcfg, world_size)
    dims.build_mesh("cpu")
    tcfg = TrainingConfig(micro_batch=2, steps=STEPS)
    pm, optimizers, runner = build_core(full_model(args), dims, pcfg, tcfg, OPT, device=CPU, n_microbatches=1)
    return dims, pm, optimizers, runner


def _steps(dims, pm, optimizers, runner, batches) -> list[tuple[float, float]]:
    """(loss, grad norm) of each step."""
    local = batches[0][0].shape[0] // dims.dp_size
    rows = slice(dims.dp_rank * local, (dims.dp_rank + 1) * local)
    out = []
    for x, y in batches:
        loss = runner.forward_backward(x[rows], y[rows])
        norm = runner.clip().item()
        optimizers.step()
        out.append((all_reduce_mean(loss, dims.submesh("dp_cp")).item(), norm))
    return out


# Several DDP buckets: a 4096-token vocabulary makes the embedding and the output layer 1 MiB each, wider blocks
# make three of them over 1 MiB, and 1 MiB buckets (parallel.ddp_bucket_mb, its smallest) split them into 3 once DDP
# has rebuilt its buckets after the first step. A fresh (resumed) process starts again from one initial bucket.
BUCKETS_ARGS = dict(vocab_size=4096, n_layers=3, ffn_hidden=512)


def _resume_facts(world_size: int, save_at: int, bucket_mb: int, **model: int) -> dict:
    """10 steps straight, against `save_at` steps, a DCP checkpoint of model + optimizer + PowerSGD state, and the
    rest in freshly built objects (whose DDP starts again from its initial buckets): their losses, grad norms and
    final weights, and the buckets PowerSGD saw."""
    pcfg = ParallelConfig(grad_compression="powersgd", powersgd_rank=RANK, powersgd_start_iter=START,
                          ddp_bucket_mb=bucket_mb)  # fmt: skip
    args = tiny_args(**model)
    batches = global_batches(args)
    dims, pm, optimizers, runner = _build(pcfg, world_size, args)
    straight = _steps(dims, pm, optimizers, runner, batches)
    buckets = len(pm.comm.powersgd.layouts)
    want = {k: v.clone() for k, v in pm.parts[0].module.state_dict().items()}
    dims, pm, optimizers, runner = _build(pcfg, world_size, args)
    first = _steps(dims, pm, optimizers, runner, batches[:save_at])
    path = [tempfile.mkdtemp(prefix="powersgd-") if dims.dp_rank == 0 else None]
    torch.distributed.broadcast_object_list(path, group=dims.control)
    state = {"model": ModelState(pm.parts), "optimizer": optimizers, "comm": pm.comm}
    dcp.save(state, checkpoint_id=path[0], process_group=dims.control)
    saved_iter = pm.comm.powersgd.state.iter
    dims, pm, optimizers, runner = _build(pcfg, world_size, args)
    state = {"model": ModelState(pm.parts), "optimizer": optimizers, "comm": pm.comm}
    dcp.load(state, checkpoint_id=path[0], process_group=dims.control)
    resumed = _steps(dims, pm, optimizers, runner, batches[save_at:])
    got = pm.parts[0].module.state_dict()
    return {"straight": straight, "resumed": first + resumed, "saved_iter": saved_iter, "buckets": buckets,
            "weights_differ": [k for k in want if not torch.equal(want[k], got[k])]}  # fmt: skip


FSDP_2 = {
    "fsdp_prefetch_2": dict(data_parallel="fsdp", fsdp_prefetch=2),
    "fsdp_keep": dict(data_parallel="fsdp", reshard_after_forward=False),
}


@pytest.fixture(scope="module")
def hooks(tmp_path_factory):
    cases = {
        "none": dict(),
        "bf16": dict(grad_compression="bf16"),
        "fp16": dict(grad_compression="fp16"),
        "powersgd": dict(grad_compression="powersgd", powersgd_rank=RANK, powersgd_start_iter=START),
        "zero1_powersgd": dict(
            data_parallel="zero1", grad_compression="powersgd", powersgd_rank=RANK, powersgd_start_iter=START
        ),
        "resume": dict(resume=dict(save_at=5, bucket_mb=25)),
        "resume_buckets": dict(resume=dict(save_at=5, bucket_mb=1, **BUCKETS_ARGS)),
        "resume_buckets_at_start": dict(resume=dict(save_at=START, bucket_mb=1, **BUCKETS_ARGS)),
        **FSDP_2,
    }
    # The FSDP layouts' weights are held to PARAM_ATOL as every other layout's (a CPU with AMX moved one by 1.2e-5).
    return run_layouts(tmp_path_factory, 2, cases, comm_case, atol_params=PARAM_ATOL)


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _params() -> list[torch.Size]:
    return [p.shape for p in full_model(tiny_args()).parameters()]


def test_half_precision_hooks_halve_the_bytes_and_follow_fp32(hooks):
    plain = hooks["none"]["facts"][0]
    grads = sum(math.prod(s) for s in _params()) * 4  # fp32; a 2-rank ring all-reduce sends 2(W-1)/W = 1 x
    assert plain["bytes"] == [grads] * STEPS
    for kind in ("bf16", "fp16"):
        got = hooks[kind]["facts"][0]
        assert got["bytes"] == [grads / 2] * STEPS, kind
        print(
            f"{kind}: max relative loss difference from fp32 DDP {_rel(got['losses'], plain['losses']):.1e}"
        )
        assert _rel(got["losses"], plain["losses"]) < HALF_RTOL
        assert got["losses"] != plain["losses"]  # the hook did run: rounding shows


def test_powersgd_bytes_fall_by_the_low_rank_factor_and_it_trains(hooks):
    plain, got = hooks["none"]["facts"][0], hooks["powersgd"]["facts"][0]
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


def test_powersgd_under_zero1_trains_as_under_ddp(hooks):
    # ZeRO-1 shards only AdamW's state; its gradients go through the same DDP hook.
    ddp, zero1 = hooks["powersgd"]["facts"][0], hooks["zero1_powersgd"]["facts"][0]
    assert zero1["bytes"] == ddp["bytes"]
    assert _rel(zero1["losses"], ddp["losses"]) < 1e-5


def test_powersgd_state_resumes_bit_for_bit(hooks):
    for facts in hooks["resume"]["facts"]:
        assert facts["buckets"] == 1
        assert facts["saved_iter"] == 5  # the state was live (compressing since step 3) when saved
        assert facts["resumed"] == facts["straight"]
        assert facts["weights_differ"] == []


@pytest.mark.parametrize("case", ["resume_buckets", "resume_buckets_at_start"])
def test_powersgd_state_over_several_buckets_resumes_bit_for_bit(hooks, case):
    """The error feedback and Q factors of several buckets, re-laid into the resumed process's single initial bucket
    and then into its rebuilt buckets: the same losses, grad norms and weights as the uninterrupted run. Saved at
    step 5 (compressing since step 3), and at step START, the last plain step, so that the first compressed step
    draws its Q factors in the resumed process."""
    for facts in hooks[case]["facts"]:
        assert facts["buckets"] >= 3
        assert facts["saved_iter"] == (5 if case == "resume_buckets" else START)
        assert facts["resumed"] == facts["straight"]
        assert facts["weights_differ"] == []


# -- FSDP2: prefetch and reshard_after_forward -----------------------------------------------------------------


def _fsdp_bytes(world: int, micro: int, reshard: bool) -> float:
    """Bytes one rank sends per step under FSDP2 (fp32, grad_sync = step): every micro-batch's forward
    all-gathers all parameters and its backward re-gathers the resharded ones: every block but the last, and the
    root (FSDP2 reshards it too); one reduce-scatter sends every gradient. The int reshard_after_forward is
    checked in tests/distributed/test_data_parallel.py (4 ranks)."""
    model = full_model(tiny_args())
    nbytes = lambda m: sum(p.numel() for p in m.parameters()) * 4  # noqa: E731
    blocks = list(model.layers.values())
    total = nbytes(model)
    root = total - sum(nbytes(b) for b in blocks)
    part = lambda w: (w - 1) / w  # noqa: E731 (a ring all-gather's share sent by each rank)
    back = part(world) * (sum(nbytes(b) for b in blocks[:-1]) + root) if reshard else 0
    return micro * (part(world) * total + back) + part(world) * total


def test_fsdp_prefetch_and_keep_match_reference_and_count_gathers(hooks):
    # layout_case: the local batch of 4 in micro-batches of 2.
    expected = {"fsdp_prefetch_2": _fsdp_bytes(2, 2, True), "fsdp_keep": _fsdp_bytes(2, 2, False)}
    for name in FSDP_2:
        every = check_equivalent(hooks, name)
        assert [f["comm_bytes"] for f in every] == [expected[name]] * 2, name


# -- Validation and resume rules (no processes) ------------------------------------------------------------------


def test_comm_problems_refuse_what_is_not_supported_with_the_fix():
    from scaletrain.parallel.layout import Layout, comm_problems

    def one(world: int = 2, **kw) -> str:
        (problem,) = comm_problems(Layout.resolve(ParallelConfig(**kw), TrainingConfig(), 64, world))
        return problem

    assert "precision.reduce_dtype = 'bf16'" in one(data_parallel="fsdp", grad_compression="bf16")
    assert "tp = pp = cp = 1" in one(tp=2, grad_compression="powersgd")
    assert "powersgd_start_iter >= 2" in one(powersgd_start_iter=1)
    assert "fsdp_prefetch must be >= 0" in one(fsdp_prefetch=-1)
    assert "must divide the 4 ranks" in one(4, data_parallel="fsdp", reshard_after_forward=3)
    assert "strictly between 1" in one(4, data_parallel="fsdp", reshard_after_forward=4)
    assert "zero2 keeps" in one(data_parallel="zero2", reshard_after_forward=True)
    assert "leave it 'auto' with ddp" in one(reshard_after_forward=False)
    zb = dict(data_parallel="fsdp", pp=2, dp_shard=2, pp_schedule="zbv", reshard_after_forward=True)
    assert "zero-bubble" in one(4, **zb)
    assert (
        comm_problems(
            Layout.resolve(
                ParallelConfig(data_parallel="fsdp", reshard_after_forward=2), TrainingConfig(), 64, 4
            )
        )
        == []
    )
    assert (
        comm_problems(
            Layout.resolve(
                ParallelConfig(data_parallel="zero1", grad_compression="powersgd"), TrainingConfig(), 64, 2
            )
        )
        == []
    )


def test_reshard_after_forward_parses_int_bool_and_auto():
    from scaletrain.config import Config
    from scaletrain.config.io import parse_overrides, to_dataclass

    for text, value in (("2", 2), ("true", True), ("false", False), ("auto", "auto")):
        raw: dict = {}
        parse_overrides(["--parallel.reshard_after_forward", text], raw)
        cfg, problems = to_dataclass(Config, raw)
        assert (
            problems == []
            and cfg.parallel.reshard_after_forward == value
            and type(value) is type(cfg.parallel.reshard_after_forward)
        )


def test_resume_refuses_switching_powersgd_on_or_its_rank_but_not_off():
    from scaletrain.run.resume import resume_problems

    def cfg(kind: str, rank: int = 1) -> dict:
        return {"parallel": {"grad_compression": kind, "powersgd_rank": rank}}

    (on,) = resume_problems(cfg("none"), cfg("powersgd"), [])
    assert "hold no PowerSGD state" in on and "grad_compression = 'none'" in on
    (rank,) = resume_problems(cfg("powersgd", 1), cfg("powersgd", 2), [])
    assert "hold rank 1 PowerSGD state" in rank
    assert resume_problems(cfg("powersgd"), cfg("none"), []) == []
    assert resume_problems(cfg("powersgd", 2), cfg("powersgd", 2), []) == []
    assert resume_problems(cfg("none"), cfg("bf16"), []) == []
