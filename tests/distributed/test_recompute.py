"""Activation recompute inside parallel layouts: with FSDP, TP + sequence parallel, pipelines and context parallel,
every policy trains 10 steps bit for bit like the same layout without recompute (losses, grad norms and every
final parameter, fp32 on CPU), and recomputes the blocks it names on each rank. The layouts without recompute are
themselves held to the single-process reference by test_hybrid_layouts.py and test_data_parallel.py."""

from __future__ import annotations

import pytest

from scaletrain.config import MemoryConfig, ParallelConfig, TrainingConfig
from scaletrain.parallel.mesh import ParallelDims
from tests.distributed.reference import (
    check_equivalent,
    full_model,
    global_batches,
    run_layouts,
    tiny_args,
    train_steps,
    unwrap,
)

_PLAIN: dict[str, object] = {}  # the layout without recompute, trained once per process and layout


def recompute_case(rank: int, world_size: int, spec: dict) -> dict:
    """spec: "mode" (memory.recompute), "m" (micro-batches), "n_layers" (2 by default: it halves the test's time),
    and ParallelConfig fields."""
    spec = dict(spec)
    mode, m, n_layers = spec.pop("mode"), spec.pop("m", 2), spec.pop("n_layers", 2)
    args = tiny_args(n_layers=n_layers)
    batches = global_batches(args)
    pcfg = ParallelConfig(**spec)
    dims = ParallelDims.from_config(pcfg, world_size)
    tcfg = TrainingConfig(micro_batch=batches[0][0].shape[0] // dims.dp_size // m)

    def train(memory: MemoryConfig | None):
        d = ParallelDims.from_config(pcfg, world_size)
        return train_steps(full_model(args), d, pcfg, batches, tcfg, n_microbatches=m, memory=memory)

    key = repr(sorted(spec.items())) + f"m={m}, n_layers={n_layers}"
    if key not in _PLAIN:
        _PLAIN[key] = train(None)
    run = train(MemoryConfig(recompute=mode, recompute_every=2))
    recomputed = sorted(
        int(k)
        for part in run.pm.parts
        for k, block in unwrap(part).layers.items()
        if "forward" in vars(block)  # apply_recompute replaced the instance's forward
    )
    return {"run": run, "ref": _PLAIN[key], "facts": {"recomputed": recomputed}}


FSDP = dict(data_parallel="fsdp")
# Each policy and each parallelism at least once, in one spawn of 4 ranks (each case trains twice: with and without).
CASES = {
    "fsdp4_selective": dict(mode="selective", **FSDP),
    "tp2_sp_fsdp2_full": dict(mode="full", tp=2, sequence_parallel=True, dp_shard=2, **FSDP),
    "pp2_fsdp2_every_k": dict(mode="every_k", pp=2, dp_shard=2, pp_schedule="1f1b", n_layers=4, **FSDP),
    "cp2_tp2_sp_selective": dict(mode="selective", cp=2, tp=2, sequence_parallel=True, **FSDP),
    # torchtitan's per-op policy on DTensor Linears (one counted mm each) and SP's saved reduce-scatters.
    "tp2_sp_fsdp2_selective_op": dict(mode="selective_op", tp=2, sequence_parallel=True, dp_shard=2, **FSDP),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    # Bitwise: rtol 0 and atol 0 against the same layout without recompute.
    return run_layouts(tmp_path_factory, 4, CASES, recompute_case, rtol=0.0, atol_params=0.0)


@pytest.mark.parametrize("name", list(CASES))
def test_recompute_in_parallel_layouts_is_bitwise_equal_to_no_recompute(results, name):
    ranks = check_equivalent(results, name)
    blocks = [r["recomputed"] for r in ranks]
    if name.startswith("pp2"):
        # Every 2nd layer of the whole model: stage 0 (ranks 0-1) holds layers 0-1, stage 1 (ranks 2-3) 2-3.
        assert blocks == [[1], [1], [3], [3]]
    else:
        assert blocks == [[0, 1]] * 4
