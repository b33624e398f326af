"""zero2's forward on gloo, against the kernel (issue 35): FSDP2 without resharding after forward holds each rank's
fp32 shard of the weights and, from their all-gather to their backward, the whole weights; at the last block's
all-gather also its flat output and the previous block's, which FSDP2 keeps until the next copy-out. That moment is
the rank's peak (memory_matrix case 5: the sum of every part's largest read 0.99 of the kernel's figure without the
two outputs). memory._moments_apart (zero2) takes the fullest moment; here it must bound what a step's forward and
backward add within 10%, and the estimate without the two outputs must fall short."""

from __future__ import annotations

import pytest

from scaletrain.config import ParallelConfig, TrainingConfig
from scaletrain.models import ModelArgs
from scaletrain.planning.estimators.memory import block_parameters, per_rank_bytes
from tests.distributed.spawn import spawn_resident_peaks
from tests.distributed.test_root_unit_memory import fsdp_backward_growth

MiB = 2**20
SEQ = 16
RANKS = 2
# Four blocks of 3.7M parameters (14 MiB fp32) and a small vocabulary: the blocks are the step.
ARGS = dict(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=2048, vocab_size=512, max_seq_len=SEQ)


def worker(rank: int, world_size: int) -> int:
    return fsdp_backward_growth(ModelArgs(**ARGS), SEQ, world_size, "zero2")


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[int]:
    return spawn_resident_peaks(worker, RANKS, tmp_path_factory, "zero2_memory")


def test_zero2s_forward_holds_the_whole_weights_and_two_all_gather_outputs(measured):
    e = per_rank_bytes(ModelArgs(**ARGS), ParallelConfig(data_parallel="zero2"), TrainingConfig(micro_batch=1),
                       SEQ, RANKS, overhead_bytes=0, gloo=True)  # fmt: skip
    # what the forward and backward add to the state a step starts from: the fp32 shards, AdamW's moments and the
    # framework (FSDP2's per-block objects, counted in "overhead")
    est = e["total"] - e["parameters"] / RANKS - e["optimizer"] - e["overhead"]
    outputs = 2 * sum(block_parameters(ModelArgs(**ARGS))) * 4
    print(round(est / MiB, 1), [round(g / MiB, 1) for g in measured])
    for rank, got in enumerate(measured):
        assert 0.9 * est <= got <= est, f"rank {rank}: measured {got / MiB:.1f} MiB, estimate {est / MiB:.1f}"
        assert got > est - outputs, (
            f"rank {rank}: {got / MiB:.1f} MiB is within the estimate less the outputs"
        )
