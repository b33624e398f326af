"""The hybrid layouts the validator accepts, each trained 10 steps against the single-process reference (losses,
grad norms and every final parameter, tests/distributed/reference.py), with its data-parallel replicas bitwise
equal: data parallel x tensor x context x pipeline parallel, and the pipeline schedules beyond plain pipelines.

The one-dimension layouts (ddp, zero1/2, fsdp, hsdp; tp; cp; each schedule alone) have their own files; the
refused combinations are tested in tests/unit/test_parallel_validate.py and test_pipeline.py
(test_pipeline_problems_name_the_fix). docs/parallelism.md lists both."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import DTensor

from scaletrain.config import ParallelConfig, TrainingConfig
from scaletrain.parallel.mesh import ParallelDims
from tests.distributed.reference import (
    PARAM_ATOL,
    check_equivalent,
    full_model,
    global_batches,
    reference_for,
    run_layouts,
    tiny_args,
    train_steps,
    unwrap,
)


def hybrid_case(rank: int, world_size: int, spec: dict) -> dict:
    """spec: ParallelConfig fields, plus for a pipeline "m" (micro-batches) and "n_layers". Without a pipeline each
    rank takes two micro-batches of its local batch; with one, the reference runs the pipeline's micro-batches."""
    spec = dict(spec)
    m, n_layers = spec.pop("m", 2), spec.pop("n_layers", 4)
    args = tiny_args(n_layers=n_layers)
    batches = global_batches(args)
    pcfg = ParallelConfig(**spec)
    dims = ParallelDims.from_config(pcfg, world_size)
    local = batches[0][0].shape[0] // dims.dp_size
    run = train_steps(
        full_model(args),
        dims,
        pcfg,
        batches,
        TrainingConfig(micro_batch=local // m),
        n_microbatches=m,
    )
    return {"run": run, "ref": reference_for(args, micro_batch=local // m), "facts": _facts(run)}


def _facts(run) -> dict:
    """What the layout did to the model: the attention kernel, wq's mesh dims and placements, the stages held."""
    inner = unwrap(run.pm.parts[0])
    wq = inner.layers[next(iter(inner.layers))].attention.wq.weight
    sharded = isinstance(wq, DTensor)
    return {
        "attention": type(inner.layers[next(iter(inner.layers))].attention.sdpa).__name__,
        "mesh_dims": list(wq.device_mesh.mesh_dim_names) if sharded else [],
        "placements": [repr(p) for p in wq.placements] if sharded else [],
        "wq_share": wq.numel() // (wq.to_local() if sharded else wq).numel(),
        "stages": run.pm.pipeline.stage_ids if run.pm.pipeline is not None else [],
    }


FSDP = dict(data_parallel="fsdp")
# name -> spec. Four ranks: every pair of dimensions, and each schedule beyond plain pipelines with data or tensor
# parallel inside its stages.
LAYOUTS_4 = {
    "cp2_fsdp2": dict(cp=2, dp_shard=2, **FSDP),
    "cp2_zero1_dp2": dict(cp=2, dp_shard=2, data_parallel="zero1"),
    "cp2_zero2_dp2": dict(cp=2, dp_shard=2, data_parallel="zero2"),
    "cp2_hsdp": dict(cp=2, dp_replicate=2, dp_shard=1, data_parallel="hsdp"),
    "cp2_tp2_sp": dict(cp=2, tp=2, sequence_parallel=True, **FSDP),
    "cp4": dict(cp=4),
    "zero1_dp4": dict(data_parallel="zero1"),
    "zero2_dp4": dict(data_parallel="zero2"),
    "pp2_cp2": dict(pp=2, cp=2, pp_schedule="1f1b", **FSDP),
    "pp2_zero2": dict(pp=2, dp_shard=2, pp_schedule="1f1b", data_parallel="zero2"),
    "pp2_tp2_sp": dict(pp=2, tp=2, sequence_parallel=True, pp_schedule="1f1b", m=4),
    "interleaved_1f1b_fsdp2": dict(pp=2, dp_shard=2, pp_schedule="interleaved_1f1b", **FSDP),
    "interleaved_zb_tp2": dict(pp=2, tp=2, pp_schedule="interleaved_zb", m=4),
    "zbv_fsdp2": dict(pp=2, dp_shard=2, pp_schedule="zbv", **FSDP),
    "dualpipev_tp2": dict(pp=2, tp=2, pp_schedule="dualpipev", m=4),
    "dualpipev_fsdp2": dict(pp=2, dp_shard=2, pp_schedule="dualpipev", m=4, **FSDP),
}
LAYOUTS_8 = {
    "hsdp_tp2": dict(dp_replicate=2, dp_shard=2, tp=2, data_parallel="hsdp"),
    "pp2_hsdp": dict(pp=2, dp_replicate=2, dp_shard=2, pp_schedule="1f1b", data_parallel="hsdp"),
}


@pytest.fixture(scope="module")
def results_4(tmp_path_factory):
    return run_layouts(tmp_path_factory, 4, LAYOUTS_4, hybrid_case, atol_params=PARAM_ATOL)


@pytest.fixture(scope="module")
def results_8(tmp_path_factory):
    return run_layouts(tmp_path_factory, 8, LAYOUTS_8, hybrid_case, atol_params=PARAM_ATOL)


@pytest.mark.parametrize("name", [n for n in LAYOUTS_4 if "cp" in n])
def test_context_parallel_hybrids_match_reference(results_4, name):
    for facts in check_equivalent(results_4, name):
        assert facts["attention"] == "RingAttention"


def test_pipeline_x_context_parallel_matches_reference(results_4):
    # The pipeline's stages run ring attention on half of every sequence, with its tokens' original positions:
    # without them (the bug this replaces) the losses part from the reference at step 1.
    ranks = check_equivalent(results_4, "pp2_cp2")
    assert [r["stages"] for r in ranks] == [[0], [0], [1], [1]]
    assert all(r["attention"] == "RingAttention" for r in ranks)


@pytest.mark.parametrize("name", ["zero1_dp4", "zero2_dp4"])
def test_zero_at_four_ranks_matches_reference(results_4, name):
    for facts in check_equivalent(results_4, name):
        assert facts["wq_share"] == (4 if name == "zero2_dp4" else 1)


@pytest.mark.parametrize(
    "name", [n for n in LAYOUTS_4 if n.startswith(("pp2_", "interleaved", "zbv", "dualpipev"))]
)
def test_pipelines_with_data_or_tensor_parallel_match_reference(results_4, name):
    for facts in check_equivalent(results_4, name):
        assert len(facts["stages"]) == (1 if name.startswith("pp2_") else 2)
        if "tp2" in name:
            assert "tp" in facts["mesh_dims"] and facts["wq_share"] == 2


@pytest.mark.parametrize("name", list(LAYOUTS_8))
def test_eight_rank_hybrids_match_reference(results_8, name):
    for facts in check_equivalent(results_8, name):
        # Replicated across the 2 groups, sharded in 2 within each, and over tp in 2 more.
        assert facts["mesh_dims"][0] == "dp_replicate" and facts["placements"][0] == "Replicate()"
        assert facts["wq_share"] == (4 if "tp2" in name else 2)
