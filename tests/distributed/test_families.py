"""The model families of issue 36 (Qwen3, Qwen3-MoE, GPT-OSS) in the 2-rank layouts the validator accepts, each
trained 10 steps against the single-process reference (losses, grad norms and every final parameter,
tests/distributed/reference.py): fsdp, tensor parallel with sequence parallel (QK-norm and the sinks split by
head), and expert parallel for the MoEs. One spawn of 2 processes runs them all, on shapes that divide nothing
they need not (dim 40, head_size 12, vocabulary 100, sequences of 24). What the validator refuses for a family
(context parallel with GPT-OSS's window and sinks) is in tests/unit/test_families.py."""

from __future__ import annotations

import pytest

from scaletrain.config import ParallelConfig, TrainingConfig
from scaletrain.models import ModelArgs
from scaletrain.parallel.mesh import ParallelDims
from tests.distributed.reference import (
    PARAM_ATOL,
    check_equivalent,
    full_model,
    global_batches,
    reference_for,
    run_layouts,
    train_steps,
)

SHAPE = dict(
    dim=40, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=72, vocab_size=100, max_seq_len=24, head_size=12
)
MOE = dict(n_experts=4, top_k=2, moe_hidden=20, aux_loss_coef=0.01)
FAMILIES = {
    "qwen3": dict(family="qwen3", qk_norm=True),
    "qwen3_moe": dict(family="qwen3", qk_norm=True, **MOE),
    # A limit of 0.5 makes the clamps bite at this scale; the window of 8 is on layer 0 only.
    "gpt_oss": dict(
        family="gpt_oss", attention_bias=True, attention_sinks=True, moe_bias=True, swiglu_limit=0.5, window=8,
        window_every=2, **MOE,
    ),
}  # fmt: skip
LAYOUTS = {
    "fsdp": dict(data_parallel="fsdp"),
    "tp2_sp": dict(tp=2, sequence_parallel=True, data_parallel="fsdp"),
    "ep2": dict(ep=2, data_parallel="fsdp"),
    "pp2": dict(pp=2, pp_schedule="1f1b"),
    "cp2": dict(cp=2),
}
# Refused by the validator, so not run: ep for a dense model (no experts), cp for a MoE (its balance loss and
# capacity are per sequence) and for GPT-OSS (the window and the sinks; ring attention has neither).
REFUSED = {("qwen3", "ep2"), ("qwen3_moe", "cp2"), ("gpt_oss", "cp2")}
CASES = {
    f"{family}-{layout}": dict(family=family, layout=fields)
    for family in FAMILIES
    for layout, fields in LAYOUTS.items()
    if (family, layout) not in REFUSED
}


def family_case(rank: int, world_size: int, spec: dict) -> dict:
    args = ModelArgs(**SHAPE, **FAMILIES[spec["family"]])
    batches = global_batches(args)
    pcfg = ParallelConfig(**spec["layout"])
    dims = ParallelDims.from_config(pcfg, world_size)
    # Micro-batches of 2 sequences in every layout, so that one reference per family serves them all.
    m = batches[0][0].shape[0] // dims.dp_size // 2
    run = train_steps(full_model(args), dims, pcfg, batches, TrainingConfig(micro_batch=2), n_microbatches=m)
    return {"run": run, "ref": reference_for(args, micro_batch=2)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_layouts(tmp_path_factory, 2, CASES, family_case, atol_params=PARAM_ATOL)


@pytest.mark.parametrize("name", list(CASES))
def test_family_layout_equals_the_single_process(results, name):
    check_equivalent(results, name)
