"""QAT in every layout the validator accepts with it (two ranks: each data-parallel mode, a pipeline, context
parallel; tensor parallel is refused) against the single-process QAT reference.

The tolerance is looser than the plain layouts' relative 1e-5, for a measured reason: fake quantisation rounds
(int4 weights: 16 levels per group), so a last-bit difference in a weight from another reduction order can move a
quantised value by a whole step; such flips compound over the steps. Measured over 10 steps of the tiny model:
the first steps agree bit for bit, then within 1.2e-3 relative (pp), 1.0e-3 (cp), 9e-4 (fsdp, zero2);
ddp is bit-equal. Over the 5 steps run here: ddp, zero1, hsdp bit-equal; fsdp, zero2 3.4e-4; pp 3.4e-4; cp 1.1e-3."""

from __future__ import annotations

import pytest

from scaletrain.config import ParallelConfig, PrecisionConfig, TrainingConfig
from scaletrain.parallel.mesh import ParallelDims
from scaletrain.precision.qat import apply_qat, fake_quantized_linears
from tests.distributed.reference import (
    full_model,
    global_batches,
    reference_run,
    run_layouts,
    tiny_args,
    train_steps,
    unwrap,
)

pytest.importorskip("torchao", reason="QAT needs torchao: the fp8 extra")

QAT = PrecisionConfig(qat="int8_int4", qat_group_size=16)
LOSS_RTOL = 3e-3  # all steps (see the module docstring)
FIRST_STEP_RTOL = 1e-5  # step 1: the same weights in every layout, so the design's tolerance holds
STEPS = 5
FSDP = dict(data_parallel="fsdp")
LAYOUTS = {
    "fsdp": FSDP,
    "ddp": dict(data_parallel="ddp"),
    "zero1": dict(data_parallel="zero1"),
    "zero2": dict(data_parallel="zero2"),
    "hsdp": dict(data_parallel="hsdp", dp_replicate=2, dp_shard=1),
    "pp2": dict(pp=2, pp_schedule="1f1b", m=2, **FSDP),
    "cp2": dict(cp=2, **FSDP),
}
_REF: list = []


def qat_case(rank: int, world_size: int, fields: dict) -> dict:
    fields = dict(fields)
    m = fields.pop("m", 1)  # pipeline micro-batches
    args = tiny_args()
    batches = global_batches(args, steps=STEPS)
    if not _REF:
        _REF.append(reference_run(apply_qat(full_model(args), QAT), batches))
    ref = _REF[0]
    pcfg = ParallelConfig(**fields)
    dims = ParallelDims.from_config(pcfg, world_size)
    local = batches[0][0].shape[0] // dims.dp_size
    tcfg = TrainingConfig(micro_batch=local // m if pcfg.pp > 1 else 4)
    run = train_steps(apply_qat(full_model(args), QAT), dims, pcfg, batches, tcfg, n_microbatches=m)
    errors = []
    rel = lambda a, b: abs(a - b) / abs(b)  # noqa: E731
    if (
        rel(run.losses[0], ref.losses[0]) > FIRST_STEP_RTOL
        or rel(run.grad_norms[0], ref.grad_norms[0]) > 1e-5
    ):
        errors.append(f"step 1: loss {run.losses[0]} / grad norm {run.grad_norms[0]} vs {ref.losses[0]} / "
                      f"{ref.grad_norms[0]}")  # fmt: skip
    worst = max(rel(a, b) for a, b in zip(run.losses, ref.losses))
    if worst > LOSS_RTOL:
        errors.append(f"losses {run.losses} vs reference {ref.losses}: {worst:.1e} relative")
    fake = sum(fake_quantized_linears(unwrap(p)) for p in run.pm.parts)
    facts = {"fake_quantized": fake, "loss_rel": worst, "replicas": run.replica_mismatches, "pp": pcfg.pp}
    return {"facts": facts, "errors": errors}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_layouts(tmp_path_factory, 2, LAYOUTS, qat_case)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_qat_trains_like_the_single_process_qat_run(results, name):
    r = results[name]
    assert not r["errors"], "\n".join(r["errors"])
    print(name, "max loss rel diff", max(f["loss_rel"] for f in r["facts"]))
    per_rank = [f["fake_quantized"] for f in r["facts"]]
    # Every block Linear (7 per block, 4 blocks) stays fake-quantised under each wrapping; a stage holds its half.
    assert per_rank == [28 // r["facts"][0]["pp"]] * 2
    assert all(not f["replicas"] for f in r["facts"])
