"""Sharded initialisation (issue 23 item 1): a model built on meta, parallelised there and materialised per rank
(parallel/materialize.py) holds exactly the single-process weights for the seed, bit for bit, in every layout —
on shapes that do not divide the world (dim 48, vocab 131, ffn 90, 3 layers) — and leaves the global RNG where
the single-process init leaves it. One spawn of 4 gloo ranks runs every layout."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from scaletrain.config import ParallelConfig
from scaletrain.models import ModelArgs, build_meta_model, build_model
from scaletrain.models.moe import MoE
from scaletrain.parallel.mesh import ParallelDims
from scaletrain.parallel.parallelize import parallelize
from tests.distributed.reference import gather_state, unwrap
from tests.distributed.spawn import spawn, spawn_gathered
from tests.gpu.test_cuda import _sharded_init_facts

CPU = torch.device("cpu")
SEED = 7
DENSE = dict(dim=48, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=90, vocab_size=131, max_seq_len=16)
MOE = dict(DENSE, n_experts=4, top_k=2, moe_hidden=40, shared_experts=1, first_dense=1)
FSDP = dict(data_parallel="fsdp")
# name -> (model fields, ParallelConfig fields): every data-parallel mode, tp, pp, cp, ep and their hybrids.
LAYOUTS = {
    "fsdp4": (DENSE, FSDP),
    "fsdp4_tied": (dict(DENSE, tie_embeddings=True), FSDP),
    "hsdp2x2": (DENSE, dict(dp_replicate=2, dp_shard=2, data_parallel="hsdp")),
    "zero2_dp4": (DENSE, dict(data_parallel="zero2")),
    "ddp4": (DENSE, dict(data_parallel="ddp")),
    "ddp4_tied": (dict(DENSE, tie_embeddings=True), dict(data_parallel="ddp")),
    "zero1_dp4": (DENSE, dict(data_parallel="zero1")),
    "tp4": (DENSE, dict(tp=4)),
    "tp2_fsdp2": (DENSE, dict(tp=2, **FSDP)),
    "tp2_sp_hsdp": (
        DENSE,
        dict(tp=2, dp_replicate=2, dp_shard=1, sequence_parallel=True, data_parallel="hsdp"),
    ),
    "pp2_fsdp2": (DENSE, dict(pp=2, pp_schedule="1f1b", **FSDP)),
    "pp2_tp2": (DENSE, dict(pp=2, tp=2, pp_schedule="1f1b")),
    "pp2_ddp2": (DENSE, dict(pp=2, pp_schedule="gpipe", data_parallel="ddp")),
    "pp2_zbv_fsdp2": (dict(DENSE, n_layers=4), dict(pp=2, pp_schedule="zbv", **FSDP)),
    "cp2_fsdp2": (DENSE, dict(cp=2, **FSDP)),
    "cp2_tp2_fsdp": (DENSE, dict(cp=2, tp=2, **FSDP)),
    "ep2_fsdp4": (MOE, dict(ep=2, **FSDP)),
    "ep4_fsdp4": (MOE, dict(ep=4, **FSDP)),
    "ep2_tp2": (MOE, dict(ep=2, tp=2, dp_shard=2, **FSDP)),
    "moe_pp2_fsdp2": (MOE, dict(pp=2, pp_schedule="1f1b", **FSDP)),
}


def reference(fields: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """The single-process weights, the RNG state the init leaves, and the RoPE table."""
    model = build_model(ModelArgs(**fields), SEED, CPU)
    return {k: v.clone() for k, v in model.state_dict().items()}, torch.get_rng_state(), model.rope


def compare(fields: dict, spec: dict, world_size: int) -> list[str]:
    """What differs from the single-process init in layout `spec` (empty: bit for bit the same)."""
    pcfg = ParallelConfig(**spec)
    dims = ParallelDims.from_config(pcfg, world_size)
    dims.build_mesh("cpu")
    m = 2 if pcfg.pp > 1 else 1
    pm = parallelize(
        build_meta_model(ModelArgs(**fields)), dims, pcfg, device=CPU, n_microbatches=m, init_seed=SEED
    )
    rng = torch.get_rng_state()
    state, (ref, ref_rng, rope) = gather_state(pm, dims), reference(fields)
    bad = [f"{k}: differs" for k in ref if k in state and not torch.equal(state[k], ref[k])]
    bad += [f"missing {k}" for k in ref if k not in state]
    bad += ["RNG state after init differs"] if not torch.equal(rng, ref_rng) else []
    for part in pm.parts:
        inner = unwrap(part)
        bad += ["rope differs"] if not torch.equal(inner.rope, rope) else []
        for name, mod in inner.named_modules():
            if isinstance(mod, MoE) and (mod.router.expert_bias.any() or mod.tokens_per_expert.any()):
                bad.append(f"{name}: MoE buffers not zero")
    return bad


def worker(rank: int, world_size: int, out: str) -> None:
    results = {}
    for name, (fields, spec) in LAYOUTS.items():
        try:
            bad = compare(fields, spec, world_size)
        except Exception as e:  # noqa: BLE001 - reported per layout, the other layouts still run
            bad = [f"{type(e).__name__}: {e}"]
        every: list = [None] * world_size
        dist.all_gather_object(every, bad)
        results[name] = [f"rank {r}: {b}" for r, bad_r in enumerate(every) for b in bad_r]
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sharded_init") / "results.json"
    spawn(worker, 4, str(out))
    with open(out) as f:
        return json.load(f)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_starts_from_the_single_process_weights(results, name):
    assert results[name] == []


def _gpu_check_section(rank: int, world_size: int) -> dict:
    return _sharded_init_facts(CPU, None)


def test_the_gpu_checks_section_holds_on_the_cpu(tmp_path):
    """The GPU check's sharded-init section (tests/gpu/test_cuda.py: FSDP2 on a one-rank device mesh, then
    materialise) run on the CPU, so its logic is tested where no GPU is."""
    (facts,) = spawn_gathered(_gpu_check_section, 1, str(tmp_path / "facts.json"))
    assert facts == {
        "cpu": {"shards": True, "devices": ["cpu"], "differ": [], "missing": [], "rng_moved": False}
    }
