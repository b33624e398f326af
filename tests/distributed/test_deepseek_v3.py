"""The DeepSeek-V3 family in the layouts the validator accepts for it, each trained 10 steps in fp32 against the
single process (losses, grad norms, every final parameter and routing bias; tests/distributed/reference.py): MLA
with a query latent, sigmoid routing in 4 groups (top 2) with the routed scale, a shared expert, a dense first
block, the balance loss and the auxiliary-loss-free bias update on; and under fsdp with the MTP module's loss. One spawn of 2 processes runs every case; tp and
cp are refused for MLA (tests/unit/test_deepseek_v3.py)."""

from __future__ import annotations

import pytest

from scaletrain.config import ParallelConfig, TrainingConfig
from scaletrain.parallel.mesh import ParallelDims
from tests.distributed.reference import (
    PARAM_ATOL,
    Run,
    check_equivalent,
    full_model,
    global_batches,
    reference_run,
    run_layouts,
    tiny_args,
    train_steps,
)
from tests.fixtures import TINY_DEEPSEEK_V3

ARGS = dict(
    TINY_DEEPSEEK_V3,
    n_layers=2,
    max_seq_len=12,
    v_head_dim=12,
    moe_hidden=32,
    aux_loss_coef=0.001,
)
GLOBAL_BATCH = 4  # 2 micro-batches of 2 sequences on one process; 1 per rank and micro-batch at dp 2
RATE = 0.01  # moe.bias_update_rate: the biases move every step, and must move alike in every layout
FSDP = dict(data_parallel="fsdp")
CASES = {
    "fsdp2": dict(**FSDP),
    "ep2_fsdp2": dict(ep=2, **FSDP),
    "pp2": dict(pp=2, pp_schedule="1f1b", m=2),
    # With the multi-token prediction module and its loss (model.mtp_depth 1), against its own reference.
    "fsdp2_mtp": dict(mtp=True, **FSDP),
}
MTP = dict(mtp_depth=1, mtp_loss_coef=0.3)


def case(rank: int, world_size: int, spec: dict) -> dict:
    spec = dict(spec)
    ref, m, mtp = spec.pop("ref"), spec.pop("m", 1), spec.pop("mtp", False)
    ref = ref["mtp" if mtp else "plain"]
    pcfg = ParallelConfig(**spec)
    dims = ParallelDims.from_config(pcfg, world_size)
    args = tiny_args(**ARGS, **(MTP if mtp else {}))
    batches = global_batches(args, GLOBAL_BATCH)
    local = batches[0][0].shape[0] // dims.dp_size
    tcfg = TrainingConfig(micro_batch=local // m, grad_clip=1.0)
    run = train_steps(full_model(args), dims, pcfg, batches, tcfg, n_microbatches=m, routing_bias_rate=RATE)
    return {"run": run, "ref": Run(ref["losses"], ref["norms"], ref["state"], [], None, None, None, None)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    summary = {}
    for name, extra in (("plain", {}), ("mtp", MTP)):
        args = tiny_args(**ARGS, **extra)
        ref = reference_run(full_model(args), global_batches(args, GLOBAL_BATCH), 2, routing_bias_rate=RATE)
        summary[name] = {"losses": ref.losses, "norms": ref.grad_norms, "state": ref.state}
        assert any(k.endswith("router.expert_bias") and v.abs().sum() > 0 for k, v in ref.state.items())
    assert any(k.startswith("mtp.") for k in summary["mtp"]["state"])
    cases = {name: {**spec, "ref": summary} for name, spec in CASES.items()}
    return run_layouts(tmp_path_factory, 2, cases, case, atol_params=PARAM_ATOL)


@pytest.mark.parametrize("name", list(CASES))
def test_layout_matches_the_single_process(results, name):
    check_equivalent(results, name)
