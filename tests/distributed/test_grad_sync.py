"""Gradient accumulation under FSDP2 (fsdp, zero2): with parallel.grad_sync = step the gradients are
reduce-scattered once per optimizer step, not after every micro-batch (1/m of the traffic), and the run still
equals the single-process reference: losses, grad norms and final parameters."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch.distributed as dist

from scaletrain.config import ParallelConfig, TrainingConfig
from scaletrain.parallel.mesh import ParallelDims
from tests.distributed.reference import assert_close_run, full_model, global_batches, reference_for, tiny_args
from tests.distributed.reference import train_steps as train
from tests.distributed.spawn import spawn

MICRO = 1  # the local batch of 4 sequences in 4 micro-batches


def _counting(calls: list[int]):
    fn = dist.reduce_scatter_single

    @functools.wraps(fn)
    def counted(*args, **kwargs):
        calls[0] += 1
        return fn(*args, **kwargs)

    return counted


def _worker(rank: int, world_size: int, out: str) -> None:
    args = tiny_args()
    batches = global_batches(args)
    result = {}
    for mode in ("fsdp", "zero2"):
        for sync in ("step", "micro_batch"):
            calls = [0]
            dist.reduce_scatter_single = _counting(calls)
            pcfg = ParallelConfig(data_parallel=mode, grad_sync=sync)
            run = train(full_model(args), ParallelDims.from_config(pcfg, world_size), pcfg, batches,
                        TrainingConfig(micro_batch=MICRO))  # fmt: skip
            dist.reduce_scatter_single = dist.reduce_scatter_single.__wrapped__
            ref = reference_for(args, micro_batch=MICRO)
            error = None
            try:
                assert_close_run(run, ref, rtol=1e-5, atol_params=2e-5)
            except AssertionError as e:
                error = str(e)
            result[f"{mode}-{sync}"] = {"reduce_scatters": calls[0], "error": error}
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def test_fsdp_reduces_gradients_once_per_step_and_still_equals_the_reference(tmp_path):
    out = tmp_path / "result.json"
    spawn(_worker, 2, str(out))
    result = json.loads(out.read_text())
    for mode in ("fsdp", "zero2"):
        once, every = result[f"{mode}-step"], result[f"{mode}-micro_batch"]
        assert once["error"] is None and every["error"] is None, result
        # The same number of parameter groups reduce in both; per micro-batch there are 4 times as many calls.
        assert once["reduce_scatters"] > 0 and every["reduce_scatters"] == 4 * once["reduce_scatters"], result
