"""What FSDP2 and tensor parallel keep in a CPU process's heap per block they wrap, beyond the tensors (issue 35):
FSDP2's parameter groups, hooks and each parameter's DTensor metadata; tp's DTensor parameters, the plan's hooks and
sharding propagation's caches. The memory check counts FSDP_UNIT_HOST_BYTES and TP_BLOCK_HOST_BYTES a block on a
CPU. Two runs of a dim-64 model on 2 gloo ranks, 2 and 34 blocks: their resident peaks differ by the tensors the
estimate predicts and, per block, no more than the constant and at least half of it (fsdp 0.34 MiB in this bare
loop with the fused AdamW, 0.37 with foreach, 0.46 through the CLI, 0.55 under zero2; tp 2 0.29 here, 0.37 with
foreach, 0.61 through the CLI with foreach; each constant the largest)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.distributed.tensor.parallel import loss_parallel

from scaletrain.config import OptimizerConfig, ParallelConfig, TrainingConfig
from scaletrain.hardware import pin_mmap_threshold
from scaletrain.models import ModelArgs, build_meta_model
from scaletrain.optim.optimizers import optimizer_builder
from scaletrain.parallel.mesh import ParallelDims
from scaletrain.parallel.parallelize import parallelize
from scaletrain.planning.estimators.memory import FSDP_UNIT_HOST_BYTES, TP_BLOCK_HOST_BYTES, per_rank_bytes
from tests.distributed.spawn import spawn_gathered

CPU = torch.device("cpu")
SEQ = 16
BLOCKS = (2, 34)
# the layout on 2 ranks and the constant it is held to: fsdp over both, or tp 2 (one data-parallel rank, no FSDP)
LAYOUTS = {"fsdp": (1, FSDP_UNIT_HOST_BYTES), "tp": (2, TP_BLOCK_HOST_BYTES)}


def _args(layers: int) -> ModelArgs:
    return ModelArgs(
        dim=64, n_layers=layers, n_heads=2, n_kv_heads=2, ffn_hidden=128, vocab_size=512, max_seq_len=SEQ
    )


def worker(rank: int, world_size: int, layers: int, tp: int) -> int:
    """This rank's resident peak over two steps, in bytes."""
    assert pin_mmap_threshold()
    args, pcfg = _args(layers), ParallelConfig(data_parallel="fsdp", tp=tp)
    dims = ParallelDims.from_config(pcfg, world_size)
    dims.build_mesh("cpu")
    model = parallelize(build_meta_model(args), dims, pcfg, device=CPU, n_microbatches=1, init_seed=0)
    opt = optimizer_builder(OptimizerConfig(), "fsdp", dims.submesh("dp_cp"))(model.parts[0])
    tokens = torch.randint(0, args.vocab_size, (1, SEQ + 1), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        with loss_parallel() if tp > 1 else contextlib.nullcontext():  # the vocabulary-split loss under tp
            model.parts[0](tokens[:, :-1], targets=tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_block_costs_about_its_constant_in_the_heap_beyond_the_tensors(layout, tmp_path):
    tp, constant = LAYOUTS[layout]

    def tensors(layers: int) -> float:
        pcfg = ParallelConfig(data_parallel="fsdp", tp=tp)
        return per_rank_bytes(_args(layers), pcfg, TrainingConfig(micro_batch=1), SEQ, 2, overhead_bytes=0,
                              )["total"]  # fmt: skip

    peaks = {n: spawn_gathered(worker, 2, str(tmp_path / f"{n}.json"), n, tp) for n in BLOCKS}
    extra = BLOCKS[1] - BLOCKS[0]
    for rank in range(2):
        grown = peaks[BLOCKS[1]][rank] - peaks[BLOCKS[0]][rank] - tensors(BLOCKS[1]) + tensors(BLOCKS[0])
        per_block = grown / extra
        print(f"{layout} rank {rank}: {per_block / 2**20:.3f} MiB a block")
        assert 0.5 * constant <= per_block <= constant, f"{per_block / 2**20:.3f} MiB a block"
