"""QK-clip (optimizer.qk_clip, scaletrain/optim/qk_clip.py) in the layouts the validator accepts, each trained 4 steps in fp32
with τ low enough to clip heads at every step, against the single-process clipped run (losses, grad norms, every
final parameter; tests/distributed/reference.py), its data-parallel replicas bitwise equal, and the same heads
clipped at every step: ddp, zero1, fsdp (also with full recompute), hsdp, tp x zero2, tp x fsdp with sequence
parallel, pipeline x fsdp (1f1b, and zbv: two stages per rank), a MoE model under expert parallel, and Muon under
tp x fsdp. Gradient accumulation: the reference takes 4 micro-batches per step. One spawn of 4 processes runs them
all."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scaletrain.config import MemoryConfig, OptimizerConfig, ParallelConfig, TrainingConfig
from scaletrain.job import build_core
from scaletrain.parallel.mesh import ParallelDims, all_reduce_mean
from tests.distributed.reference import (
    CPU,
    OPT,
    PARAM_ATOL,
    Run,
    check_equivalent,
    full_model,
    gather_state,
    global_batches,
    replica_mismatches,
    run_layouts,
    tiny_args,
)

STEPS = 4
# The tiny model's largest logits are 0.1 to 0.3 over these steps: every step clips some of its heads.
TAU = 0.1
MOE = dict(n_layers=2, max_seq_len=16, n_experts=8, top_k=2, moe_hidden=32, first_dense=1, aux_loss_coef=0.01)
OPTIMIZERS = {
    "adamw": replace(OPT, qk_clip=TAU),
    "muon": OptimizerConfig(name="muon", lr=3e-3, warmup_steps=2, weight_decay=0.1, qk_clip=TAU),
}
FSDP = dict(data_parallel="fsdp")


def _train(
    dims: ParallelDims, pcfg: ParallelConfig, kind: str, opt: str, m: int, recompute: str = "none"
) -> tuple[Run, list, list]:
    """train_steps with QK-clip, also reading each step's clip figures: the heads clipped, as (layer, head) pairs of
    the global maxima over τ that the clip decided on (read through a wrapper of its `_global_maxima`), their count
    in the metrics, and the max logit."""
    if dims.mesh is None and dims.world_size > 1:
        dims.build_mesh("cpu")
    args = tiny_args(**MOE) if kind == "moe" else tiny_args()
    batches = global_batches(args, steps=STEPS)
    local = batches[0][0].shape[0] // dims.dp_size
    tcfg = TrainingConfig(micro_batch=local // m, grad_clip=1.0, steps=STEPS)
    pm, opts, runner = build_core(
        full_model(args),
        dims,
        pcfg,
        tcfg,
        OPTIMIZERS[opt],
        device=CPU,
        n_microbatches=m,
        memory=MemoryConfig(recompute=recompute),
    )
    rows = slice(dims.dp_rank * local, (dims.dp_rank + 1) * local)
    clip, tables = opts.qk_clip, []
    maxima = clip._global_maxima

    def recorded():
        tables.append(maxima())
        return tables[-1]

    clip._global_maxima = recorded
    losses, norms, clipped, logits = [], [], [], []
    for x, y in batches:
        loss = runner.forward_backward(x[rows], y[rows])
        norms.append(runner.clip().item())
        opts.step()
        losses.append(all_reduce_mean(loss, dims.submesh("dp_cp")).item())
        heads = (tables[-1] > clip.tau).nonzero().tolist()
        assert clip.metrics()["qk_clipped_heads"] == len(heads), (clip.metrics(), heads)
        clipped.append(heads)
        logits.append(clip.metrics()["max_attn_logit"])
    run = Run(
        losses, norms, gather_state(pm, dims), replica_mismatches(pm.parts, dims), pm, dims, runner, opts
    )
    return run, clipped, logits


def qk_case(rank: int, world_size: int, spec: dict) -> dict:
    """spec: ParallelConfig fields, plus "kind" (dense or moe), "opt" (adamw or muon), "m" (micro-batches per
    rank), "recompute" (memory.recompute) and "refs" (the reference summary of each (kind, opt))."""
    spec = dict(spec)
    refs, kind, opt, m = (
        spec.pop("refs"),
        spec.pop("kind", "dense"),
        spec.pop("opt", "adamw"),
        spec.pop("m", 1),
    )
    recompute = spec.pop("recompute", "none")
    pcfg = ParallelConfig(**spec)
    run, clipped, logits = _train(ParallelDims.from_config(pcfg, world_size), pcfg, kind, opt, m, recompute)
    ref = refs[f"{kind}-{opt}"]
    ref_run = Run(ref["losses"], ref["norms"], ref["state"], [], None, None, None, None)
    errors = []
    if clipped != ref["clipped"]:
        errors.append(f"heads clipped per step (layer, head) {clipped} vs reference {ref['clipped']}")
    if any(abs(a - b) > 1e-5 * abs(b) for a, b in zip(logits, ref["logits"], strict=True)):
        errors.append(f"max logit per step {logits} vs reference {ref['logits']}")
    return {"run": run, "ref": ref_run, "errors": errors}


CASES = {
    "ddp4": dict(),
    "zero1_dp4": dict(data_parallel="zero1"),
    "fsdp4": dict(**FSDP),
    "fsdp4_recompute": dict(recompute="full", **FSDP),  # each block's forward runs again in backward
    "hsdp_2x2": dict(dp_replicate=2, dp_shard=2, data_parallel="hsdp"),
    "tp2_sp_fsdp2": dict(tp=2, sequence_parallel=True, m=2, **FSDP),
    "tp2_zero2": dict(tp=2, data_parallel="zero2", m=2),
    "pp2_fsdp2": dict(pp=2, dp_shard=2, pp_schedule="1f1b", m=2, **FSDP),
    "zbv_fsdp2": dict(pp=2, dp_shard=2, pp_schedule="zbv", m=2, **FSDP),  # two stages per rank, a V
    "moe_ep2_fsdp4": dict(kind="moe", ep=2, **FSDP),
    "muon_tp2_fsdp2": dict(opt="muon", tp=2, m=2, **FSDP),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    refs = {}
    for kind, opt in (("dense", "adamw"), ("moe", "adamw"), ("dense", "muon")):
        pcfg = ParallelConfig()
        # 2 sequences per micro-batch: 4 micro-batches, whose maxima the step combines.
        run, clipped, logits = _train(ParallelDims.from_config(pcfg, 1), pcfg, kind, opt, 4)
        # τ clips some heads, not all, at most steps (else the comparison would prove nothing of the clip).
        heads = 4 * (MOE["n_layers"] if kind == "moe" else 4)
        assert sum(0 < len(c) < heads for c in clipped) >= STEPS // 2, (kind, opt, clipped)
        refs[f"{kind}-{opt}"] = dict(losses=run.losses, norms=run.grad_norms, state=run.state, clipped=clipped,
                                     logits=logits)  # fmt: skip
    return run_layouts(tmp_path_factory, 4, {k: {**v, "refs": refs} for k, v in CASES.items()}, qk_case,
                       atol_params=PARAM_ATOL)  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_qk_clip_in_each_layout_matches_the_single_process_clipped_run(results, name):
    check_equivalent(results, name)
