"""Mixture of experts in every layout the validator accepts for it, each trained 10 steps in fp32 against the
single-process reference (losses, grad norms, every final parameter, tests/distributed/reference.py): plain MoE
under DDP and FSDP (the per-sequence balance loss makes any batch split train the same model), expert parallel
ep 2 and 4 carved from dp_shard (with recompute), expert parallel inside pipeline stages, tensor parallel (with
sequence parallel, and with ep) over replicated MoE blocks, and a checkpoint saved under ep 2 that resumes under
ep 4 and ep 1 and continues the reference run. One spawn of 4 processes runs them all. The refusals (cp, ep
with another data-parallel mode, sizes) are in tests/unit/test_parallel_validate.py."""

from __future__ import annotations

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from scaletrain.config import MemoryConfig, ParallelConfig, TrainingConfig
from scaletrain.parallel.expert_parallel import is_expert_param
from scaletrain.parallel.mesh import ParallelDims
from tests.distributed.reference import (
    PARAM_ATOL,
    STEPS,
    Run,
    check_equivalent,
    full_model,
    global_batches,
    reference_run,
    run_layouts,
    tiny_args,
    train_steps,
    unwrap,
)

# 8 experts (ep 4 leaves 2 per rank, so the regrouping by local expert is exercised), top-2, both balance losses,
# a capacity that drops tokens, a shared expert and a dense first block (a stage may mix both kinds).
ARGS = dict(
    n_layers=3,
    max_seq_len=16,
    n_experts=8,
    top_k=2,
    moe_hidden=32,
    shared_experts=1,
    first_dense=1,
    aux_loss_coef=0.01,
    z_loss_coef=0.001,
    capacity_factor=1.5,
)
FSDP = dict(data_parallel="fsdp")


def _train(
    dims: ParallelDims, pcfg: ParallelConfig, args, steps: range, m: int, load: str, save: str, recompute: str
) -> Run:
    """train_steps (reference.py) over `steps` of the STEPS-long schedule, with a checkpoint (DCP: the model and
    optimizer, as train.py saves them) loaded from `load` first and saved to `save` after half the steps."""
    batches = global_batches(args)
    local = batches[0][0].shape[0] // dims.dp_size
    tcfg = TrainingConfig(micro_batch=local // m, grad_clip=1.0, steps=STEPS)
    memory = MemoryConfig(recompute=recompute)
    return train_steps(full_model(args), dims, pcfg, batches, tcfg, n_microbatches=m, memory=memory,
                       first=steps.start, load=load, save=save)  # fmt: skip


def moe_case(rank: int, world_size: int, spec: dict) -> dict:
    """spec: ParallelConfig fields, plus "ref" (the reference's losses, grad norms and final state, computed once
    by the parent), "m" (micro-batches per rank: every layout runs micro-batches of 2 sequences, as the
    reference), and a checkpoint directory to "save" to (after half the steps) or to "load" from (then only the
    second half is trained, and compared with the reference's)."""
    spec = dict(spec)
    ref, m = spec.pop("ref"), spec.pop("m", 1)
    load, save, recompute = spec.pop("load", ""), spec.pop("save", ""), spec.pop("recompute", "none")
    pcfg = ParallelConfig(**spec)
    dims = ParallelDims.from_config(pcfg, world_size)
    steps = range(STEPS // 2 if load else 0, STEPS)
    run = _train(dims, pcfg, tiny_args(**ARGS), steps, m, load, save, recompute)
    losses, norms = ref["losses"][steps.start :], ref["norms"][steps.start :]
    ref_run = Run(losses, norms, ref["state"], [], None, None, None, None)
    facts = _facts(run)
    if load:
        # DCP holds each expert tensor whole (its global shape, whatever ep saved it), and the routing bias.
        meta = dcp.FileSystemReader(load).read_metadata().state_dict_metadata
        facts["saved_w1"] = list(meta["model.layers.1.feed_forward.experts.w1"].size)
        facts["saved_bias"] = "model.layers.1.feed_forward.router.expert_bias" in meta
    # Tensor parallel reorders the dense layers' sums (row-split wo and w2); top-k routing and the capacity cut are
    # discontinuous, so such roundings move the MoE model more than a dense one: with 4 layers of 32 tokens the last
    # grad norms of tp 2 x sp differed by 1.7e-5 (measured; 2.3e-7 with these args). That layout in float64 differs
    # by 1.5e-6 (the dense model's 4e-7; what stays float32 there, e.g. the loss, limits both): no mechanism error,
    # hence 3e-5 for tp.
    return {"run": run, "ref": ref_run, "facts": facts, "rtol": 3e-5 if pcfg.tp > 1 else 1e-5}


def _facts(run: Run) -> dict:
    """How the first MoE block's experts are held: their mesh dims, this rank's share of w1, the ep size; the
    router's mesh."""
    inner = unwrap(run.pm.parts[-1])
    block = next(b for b in inner.layers.values() if hasattr(b.feed_forward, "experts"))
    moe, wq = block.feed_forward, block.attention.wq.weight
    w1 = moe.experts.w1
    sharded = isinstance(w1, DTensor)
    return {
        "expert_mesh": list(w1.device_mesh.mesh_dim_names) if sharded else [],
        "w1_share": w1.numel() // (w1.to_local() if sharded else w1).numel(),
        "expert_param": is_expert_param(w1),
        "ep": w1.device_mesh["ep"].size() if is_expert_param(w1) else 1,
        "wq_mesh": list(wq.device_mesh.mesh_dim_names) if isinstance(wq, DTensor) else [],
        "gate_mesh": list(moe.router.gate.weight.device_mesh.mesh_dim_names)
        if isinstance(moe.router.gate.weight, DTensor)
        else [],
    }


def _layouts(ref: dict, ckpt: str) -> dict:
    """Every case of the one spawn. ep 2 saves a checkpoint halfway; ep 4 and ep 1 (fsdp over 4) load it and
    train the second half."""
    cases = {
        "moe_ddp4": dict(),
        "moe_fsdp4": dict(**FSDP),
        # Recompute re-runs each block's forward, all-to-alls included, inside backward.
        "ep4_fsdp4_recompute": dict(ep=4, recompute="full", **FSDP),
        "ep2_fsdp4": dict(ep=2, save=ckpt, **FSDP),
        "pp2_ep2_fsdp2": dict(pp=2, dp_shard=2, ep=2, pp_schedule="1f1b", m=2, **FSDP),
        # Tensor parallel splits the dense layers and replicates the MoE blocks (sequence gathered in, split out).
        "tp2_sp_fsdp2": dict(tp=2, sequence_parallel=True, m=2, **FSDP),
        "tp2_ep2_fsdp2": dict(tp=2, ep=2, m=2, **FSDP),
        "resume_ep4": dict(ep=4, load=ckpt, **FSDP),
        "resume_ep1": dict(load=ckpt, **FSDP),
    }
    return {name: {**spec, "ref": ref} for name, spec in cases.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    args = tiny_args(**ARGS)
    ref = reference_run(full_model(args), global_batches(args), micro_batch=2)
    summary = {"losses": ref.losses, "norms": ref.grad_norms, "state": ref.state}
    ckpt = str(tmp_path_factory.mktemp("ep_ckpt") / "ep2")
    return run_layouts(tmp_path_factory, 4, _layouts(summary, ckpt), moe_case, atol_params=PARAM_ATOL)


@pytest.mark.parametrize("name", ["moe_ddp4", "moe_fsdp4"])
def test_moe_without_expert_parallel_matches_reference(results, name):
    for facts in check_equivalent(results, name):
        assert facts["expert_mesh"] == (["dp_shard_cp"] if "fsdp" in name else [])
        assert not facts["expert_param"]


@pytest.mark.parametrize("name, ep", [("ep4_fsdp4_recompute", 4), ("ep2_fsdp4", 2)])
def test_expert_parallel_matches_reference(results, name, ep):
    for facts in check_equivalent(results, name):
        # Experts: split over ep and again over the dp_shard / ep ranks holding the same ones (4 ways in all);
        # the router stays a dense weight over the whole dp_shard mesh.
        assert facts["expert_mesh"] == ["dp_mod_ep", "ep"] and facts["expert_param"]
        assert facts["w1_share"] == 4 and facts["ep"] == ep
        assert facts["gate_mesh"] == ["dp_shard_cp"]


def test_expert_parallel_inside_pipeline_stages_matches_reference(results):
    for facts in check_equivalent(results, "pp2_ep2_fsdp2"):
        assert facts["expert_mesh"] == ["dp_mod_ep", "ep"] and facts["w1_share"] == 2


@pytest.mark.parametrize("name", ["resume_ep4", "resume_ep1"])
def test_checkpoint_saved_under_ep2_resumes_in_other_layouts(results, name):
    for facts in check_equivalent(results, name):
        assert facts["expert_param"] == (name == "resume_ep4")
        assert facts["saved_w1"] == [ARGS["n_experts"], ARGS["moe_hidden"], 64] and facts["saved_bias"]


@pytest.mark.parametrize("name", ["tp2_sp_fsdp2", "tp2_ep2_fsdp2"])
def test_tensor_parallel_with_replicated_moe_blocks_matches_reference(results, name):
    for facts in check_equivalent(results, name):
        # The experts are not split over tp: only FSDP (2) and, with ep, expert parallel (2 more) split them.
        assert facts["w1_share"] == 2 and facts["ep"] == (2 if "ep2" in name else 1)
        assert facts["wq_mesh"] == ["dp_shard_cp", "tp"]
