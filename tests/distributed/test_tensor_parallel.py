"""Tensor parallel, with and without sequence parallel, alone and under FSDP, against the single-process
reference (same losses, grad norms and final weights over 10 steps, through `train_steps`), plus checks of what
each layout shards."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Shard

from tests.distributed.reference import PARAM_ATOL, check_equivalent, run_layouts

LAYOUTS_2 = {
    "tp": dict(tp=2),
    "tp_sp": dict(tp=2, sequence_parallel=True),
}
LAYOUTS_4 = {
    "fsdp_tp": dict(data_parallel="fsdp", tp=2),
    "fsdp_tp_sp": dict(data_parallel="fsdp", tp=2, sequence_parallel=True),
}


@pytest.fixture(scope="module")
def results_2(tmp_path_factory):
    return run_layouts(tmp_path_factory, 2, LAYOUTS_2, atol_params=PARAM_ATOL)


@pytest.fixture(scope="module")
def results_4(tmp_path_factory):
    return run_layouts(tmp_path_factory, 4, LAYOUTS_4, atol_params=PARAM_ATOL)


@pytest.mark.parametrize("name", ["tp", "tp_sp"])
def test_tp_matches_reference(results_2, name):
    for facts in check_equivalent(results_2, name):
        # wq is split by output columns (whole heads), norms are replicated DTensors on the same mesh.
        assert facts["placements"] == [repr(Shard(0))] and facts["norm_dtensor"]
        assert facts["wq_local_numel"] * 2 == facts["wq_numel"]
        # Sequence parallel: the residual stream enters each block sharded on the sequence; without it, whole.
        assert facts["block_input"] == (repr((Shard(1),)) if name == "tp_sp" else "plain")
        assert facts["block_input_len"] == (16 if name == "tp_sp" else 32)


@pytest.mark.parametrize("name", ["fsdp_tp", "fsdp_tp_sp"])
def test_fsdp_x_tp_matches_reference(results_4, name):
    for facts in check_equivalent(results_4, name):
        # 2-D parameters: FSDP's shard over dp_shard_cp on top of TP's: a quarter each.
        assert facts["mesh"] == 2 and facts["wq_local_numel"] * 4 == facts["wq_numel"]
