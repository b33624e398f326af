"""Data-parallel layouts (DDP, ZeRO-1, ZeRO-2, FSDP, HSDP) against the single-process reference: same losses, grad
norms and final weights over 10 steps, replicas identical on every data-parallel rank, plus checks that each
layout really shards what it promises.

Each spawn runs several layouts of one world size through `train_steps` (tests/distributed/reference.py); rank 0
writes what it measured to a JSON file that the parametrized tests read, so each layout passes or fails on its own."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard

from tests.distributed.reference import PARAM_ATOL, check_equivalent, full_model, run_layouts, tiny_args

LAYOUTS_2 = {
    "ddp": dict(data_parallel="ddp"),
    "zero1": dict(data_parallel="zero1"),
    "zero2": dict(data_parallel="zero2"),
    "fsdp": dict(data_parallel="fsdp"),
}
LAYOUTS_4 = {
    "fsdp": dict(data_parallel="fsdp"),
    "hsdp": dict(data_parallel="hsdp", dp_replicate=2, dp_shard=2),
    "fsdp_reshard_2": dict(data_parallel="fsdp", reshard_after_forward=2),
}


@pytest.fixture(scope="module")
def results_2(tmp_path_factory):
    return run_layouts(tmp_path_factory, 2, LAYOUTS_2, atol_params=PARAM_ATOL)


@pytest.fixture(scope="module")
def results_4(tmp_path_factory):
    return run_layouts(tmp_path_factory, 4, LAYOUTS_4, atol_params=PARAM_ATOL)


def test_ddp_matches_reference(results_2):
    for facts in check_equivalent(results_2, "ddp"):
        assert facts["ddp"] and not facts["dtensor"]
        assert facts["opt_local_numel"] == facts["numel"]
        # The replicas stayed bitwise equal (check_equivalent), and the check would have seen one ulp of difference.
        assert facts["replica_check_catches"] is True


def test_zero1_matches_reference_and_shards_optimizer_state(results_2):
    every = check_equivalent(results_2, "zero1")
    for facts in every:
        assert facts["ddp"] and facts["replica_check_catches"] is True
        # Parameters are split whole between ranks, greedily by size: about half each.
        assert 0.3 * facts["numel"] < facts["opt_local_numel"] < 0.7 * facts["numel"]
    assert sum(f["opt_local_numel"] for f in every) == every[0]["numel"]  # each parameter on exactly one rank


@pytest.mark.parametrize("mode", ["zero2", "fsdp"])
def test_sharded_data_parallel_matches_reference(results_2, mode):
    for facts in check_equivalent(results_2, mode):
        assert facts["dtensor"] and facts["placements"] == [repr(Shard(0))]
        assert facts["wq_local_numel"] * 2 == facts["wq_numel"]
        assert facts["opt_local_numel"] * 2 == facts["numel"]
        # ZeRO-2 keeps a block's gathered weights from its forward to its backward; FSDP frees them after forward.
        assert facts["kept_gathered"] == (mode == "zero2")
        # Nothing is replicated bitwise: the replica check compares the gathered weights.
        assert facts["replica_check_catches"] is None


def test_fsdp_4_matches_reference(results_4):
    for facts in check_equivalent(results_4, "fsdp"):
        assert facts["wq_local_numel"] * 4 == facts["wq_numel"]


def test_hsdp_2x2_matches_reference(results_4):
    for facts in check_equivalent(results_4, "hsdp"):
        # Replicated across the 2 groups, sharded in 2 within each.
        assert facts["placements"] == [repr(Replicate()), repr(Shard(0))]
        assert facts["wq_local_numel"] * 2 == facts["wq_numel"]
        # The replicate dim's shards stayed bitwise equal, and one ulp on one replica would have been seen.
        assert facts["replica_check_catches"] is True


def test_fsdp_reshard_to_pairs_matches_reference(results_4):
    """parallel.reshard_after_forward = 2: between forward and backward each block stays sharded over pairs, so
    its backward all-gather sends 1/2 instead of 3/4 of the block from each rank (counted: parallel/comm.py)."""
    pairs, full = check_equivalent(results_4, "fsdp_reshard_2"), check_equivalent(results_4, "fsdp")
    blocks = list(full_model(tiny_args()).layers.values())[:-1]  # the last block is never resharded
    resharded = sum(p.numel() for b in blocks for p in b.parameters()) * 4  # fp32 bytes
    micro = 2  # the local batch of 2 in micro-batches of 1: two backward all-gathers per step
    for got, ref in zip(pairs, full, strict=True):
        assert ref["comm_bytes"] - got["comm_bytes"] == micro * (3 / 4 - 1 / 2) * resharded
