"""Tensor parallel's embedding gradient (issue 35): torch's DTensor computes the vocabulary-split embedding's
gradient replicated, the whole table on every tp rank (embedding_dense_backward, torch 2.13). FSDP2 redistributes
it to its parameter's placement; without FSDP it stayed whole through the optimizer step, and
benchmarks/memory_matrix.py's tp-only case read 26, 43 and 66 MiB over its estimate at vocabularies of 8000, 32000
and 64000 (one table shard more each time). tensor_parallel.split_embedding_grad splits it as soon as it is
accumulated: each rank holds its rows only, the gradient bytes equal the estimate's (the split count), and training
gives what the single process gives (test_tensor_parallel, tests/distributed/test_hybrid_layouts)."""

from __future__ import annotations

import torch
from torch.distributed.tensor.parallel import loss_parallel

from scaletrain.config import ParallelConfig, TrainingConfig
from scaletrain.models import ModelArgs, build_meta_model
from scaletrain.parallel.mesh import ParallelDims
from scaletrain.parallel.parallelize import parallelize
from scaletrain.planning.estimators.memory import GRAD_BYTES, per_rank_bytes
from tests.distributed.spawn import spawn_gathered

SEQ = 16
ARGS = dict(dim=64, n_layers=1, n_heads=2, n_kv_heads=2, ffn_hidden=128, vocab_size=4096, max_seq_len=SEQ)
PARALLEL = ParallelConfig(data_parallel="fsdp", tp=2)  # 2 ranks: tp 2, no data parallel, so no FSDP


def worker(rank: int, world_size: int) -> dict:
    args = ModelArgs(**ARGS)
    dims = ParallelDims.from_config(PARALLEL, world_size)
    dims.build_mesh("cpu")
    model = parallelize(build_meta_model(args), dims, PARALLEL, device=torch.device("cpu"), n_microbatches=1,
                        init_seed=0).parts[0]  # fmt: skip
    tokens = torch.randint(0, args.vocab_size, (1, SEQ + 1), generator=torch.Generator().manual_seed(0))
    with loss_parallel():
        model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
    local = {
        n: p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for n, p in model.named_parameters()
    }
    return {"bytes": sum(g.untyped_storage().nbytes() for g in local.values()),
            "embedding": list(local["tok_embeddings.weight"].shape)}  # fmt: skip


def test_a_tp_ranks_embedding_gradient_is_split_as_its_weight(tmp_path):
    measured = spawn_gathered(worker, 2, str(tmp_path / "results.json"))
    args = ModelArgs(**ARGS)
    est = per_rank_bytes(args, PARALLEL, TrainingConfig(micro_batch=1), SEQ, 2, overhead_bytes=0, gloo=True)
    table = args.vocab_size * args.dim * GRAD_BYTES
    for rank, got in enumerate(measured):
        assert got["embedding"] == [args.vocab_size // 2, args.dim], got  # this rank's rows, as its weight
        # Left whole (torch's replicated gradient), it would hold half a table more than the estimate.
        assert got["bytes"] == est["gradients"], (rank, got["bytes"], est["gradients"], table / 2)
