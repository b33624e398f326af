"""Muon (optimizer.name = "muon", scaletrain/optim/muon.py) in the layouts the validator accepts, each trained 10 steps in
fp32 against the single-process Muon run (losses, grad norms, every final parameter; tests/distributed/reference.py),
its data-parallel replicas bitwise equal: ddp, zero1 (each rank orthogonalises its share), zero2, fsdp, hsdp, tp x
fsdp with sequence parallel, pipeline x fsdp, context x fsdp, and a MoE model's 3-D experts under expert parallel
(orthogonalised per expert). In every layout the distributed orthogonalisation gives the very bits of
newton_schulz on the whole matrix (what one process computes), and the layouts the batched exchanges serve (ddp,
zero2, fsdp, hsdp) send one collective pair per bucket of matrices, not per matrix (issue 40). A checkpoint saved
under fsdp halfway resumes under tp x fsdp, zero1, pipeline and ep and continues the reference run. One spawn of 4
processes runs them all."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from scaletrain.config import OptimizerConfig, ParallelConfig, TrainingConfig
from scaletrain.optim import muon
from scaletrain.optim.muon import Muon
from scaletrain.parallel.mesh import ParallelDims
from tests.distributed.reference import (
    PARAM_ATOL,
    STEPS,
    Run,
    check_equivalent,
    full_model,
    global_batches,
    run_layouts,
    tiny_args,
    train_steps,
    unwrap,
)

MUON = OptimizerConfig(name="muon", lr=3e-3, warmup_steps=2, schedule="cosine", weight_decay=0.1)
# The MoE model of test_expert_parallel.py, smaller: 8 experts of [32, 64], top-2, a dense first block.
MOE = dict(n_layers=2, max_seq_len=16, n_experts=8, top_k=2, moe_hidden=32, first_dense=1, aux_loss_coef=0.01)
FSDP = dict(data_parallel="fsdp")
# The final momentum buffers of a resumed run against the reference's, relative to each buffer's largest entry.
MOMENTUM_RTOL = 1e-4


def _args(kind: str):
    return tiny_args(**MOE) if kind == "moe" else tiny_args()


def _train(
    dims: ParallelDims, pcfg: ParallelConfig, kind: str, steps: range, m: int, load: str, save: str
) -> Run:
    """train_steps with Muon over `steps` of the 10-step schedule, loading a DCP checkpoint (model and optimizer,
    as train.py saves them) from `load` first and saving one to `save` after half the steps."""
    args = _args(kind)
    batches = global_batches(args)
    local = batches[0][0].shape[0] // dims.dp_size
    tcfg = TrainingConfig(micro_batch=local // m, grad_clip=1.0, steps=STEPS)
    return train_steps(full_model(args), dims, pcfg, batches, tcfg, opt_cfg=MUON, n_microbatches=m,
                       first=steps.start, load=load, save=save)  # fmt: skip


def muon_case(rank: int, world_size: int, spec: dict) -> dict:
    """spec: ParallelConfig fields, plus "kind" (dense or moe), "refs" (each kind's reference summary), "m"
    (micro-batches per rank) and a checkpoint directory to "save" to or "load" from (then only the second half is
    trained and compared)."""
    spec = dict(spec)
    refs, kind, m = spec.pop("refs"), spec.pop("kind", "dense"), spec.pop("m", 1)
    load, save = spec.pop("load", ""), spec.pop("save", "")
    pcfg = ParallelConfig(**spec)
    dims = ParallelDims.from_config(pcfg, world_size)
    steps = range(STEPS // 2 if load else 0, STEPS)
    # Count the Newton-Schulz runs of this rank (the owners' share of the work), training the second half only
    # when loading (loading runs one zero-lr step to make the state: counted too).
    calls = []
    original, collectives = muon.newton_schulz, _Counting(muon.dist)
    muon.newton_schulz = lambda g, *a, **k: calls.append(g.shape) or original(g, *a, **k)
    muon.dist = collectives
    try:
        run = _train(dims, pcfg, kind, steps, m, load, save)
    finally:
        muon.newton_schulz, muon.dist = original, collectives.module
    ref = refs[kind]
    ref_run = Run(
        ref["losses"][steps.start :], ref["norms"][steps.start :], ref["state"], [], None, None, None, None
    )
    facts = {
        **_facts(run),
        "ns_calls": len(calls),
        "collectives": {k: v / len(steps) for k, v in collectives.calls.items()},  # per step
        "momentum": _momentum_diffs(run, ref["momentum"]),
        "inexact": _inexact(run),
    }
    return {"run": run, "ref": ref_run, "facts": facts}


class _Counting:
    """torch.distributed as muon.py sees it, counting the collectives it calls by name."""

    def __init__(self, module) -> None:
        self.module, self.calls = module, {}

    def __getattr__(self, name: str):
        attr = getattr(self.module, name)
        if name not in ("all_to_all_single", "all_gather", "broadcast"):
            return attr

        def counted(*a, **k):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*a, **k)

        return counted


def _inexact(run: Run) -> list[str]:
    """The Muon matrices whose distributed orthogonalisation (Muon.orthogonalise, every path) differs in any bit
    from newton_schulz of the whole matrix, the single process's computation: each final momentum buffer
    orthogonalised into a zero matrix placed as its parameter (0 * 1 + 1 * O is O exactly)."""
    bad = []
    for opt in run.optimizers.optimizers:
        opt = getattr(opt, "optim", opt)
        named = [(i, p) for g in opt.param_groups if g["muon"] for i, p in enumerate(g["params"])]
        jobs = [muon.Job(torch.zeros_like(p), opt.state[p]["momentum_buffer"], 1.0) for _, p in named]
        with torch.no_grad():
            opt.orthogonalise(jobs, 5, 1.0)
        for (i, _), job in zip(named, jobs):
            whole = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
            if not torch.equal(whole(job.p), muon.newton_schulz(whole(job.update), 5)):
                bad.append(f"{i}: {tuple(job.p.shape)}")
    return bad


def _momentum(run: Run) -> dict[str, torch.Tensor]:
    """This rank's Muon momentum buffers by name (`state.<fqn>.momentum_buffer`, as checkpoints save them), each
    whole (DTensors gathered: every rank of a part's mesh calls this, in the same order)."""
    sd = run.optimizers.state_dict()
    return {k: v.full_tensor() if isinstance(v, DTensor) else v.detach().clone() for k, v in sd.items()
            if k.endswith(".momentum_buffer")}  # fmt: skip


def _momentum_diffs(run: Run, ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each of this rank's final momentum buffers against the reference run's: the largest difference relative to
    the buffer's largest entry."""
    return {k: ((v - ref[k]).abs().max() / ref[k].abs().max()).item() for k, v in _momentum(run).items()}


def _facts(run: Run) -> dict:
    """What this rank's Muon orthogonalised: its matrices' placements and how many it held (zero1: its share)."""
    opts = [getattr(o, "optim", o) for o in run.optimizers.optimizers]
    muon = [p for o in opts for g in o.param_groups if g["muon"] for p in g["params"]]
    inner = unwrap(run.pm.parts[-1])
    experts = [b.feed_forward.experts.w1 for b in inner.layers.values() if hasattr(b.feed_forward, "experts")]
    return {
        "muon": all(isinstance(o, Muon) for o in opts),
        "muon_params": len(muon),
        "dtensor": any(isinstance(p, DTensor) for p in muon),
        "expert_mesh": list(experts[0].device_mesh.mesh_dim_names)
        if experts and isinstance(experts[0], DTensor)
        else [],
    }


def _checked(results: dict, name: str) -> list[dict]:
    """check_equivalent, and the orthogonalisation bit-exact on every rank."""
    ranks = check_equivalent(results, name)
    assert not any(r["inexact"] for r in ranks), [r["inexact"] for r in ranks]
    return ranks


def _layouts(refs: dict, ckpt: str) -> dict:
    cases = {
        "ddp4": dict(m=1),
        "zero1_dp4": dict(data_parallel="zero1"),
        "zero2_dp4": dict(data_parallel="zero2"),
        "fsdp4": dict(save=ckpt, **FSDP),
        "hsdp_2x2": dict(dp_replicate=2, dp_shard=2, data_parallel="hsdp"),
        "tp2_sp_fsdp2": dict(tp=2, sequence_parallel=True, m=2, **FSDP),
        "pp2_fsdp2": dict(pp=2, dp_shard=2, pp_schedule="1f1b", m=2, **FSDP),
        "cp2_fsdp2": dict(cp=2, dp_shard=2, m=2, **FSDP),
        "moe_ep2_fsdp4": dict(kind="moe", ep=2, **FSDP),
        "moe_tp2_ep2_fsdp2": dict(kind="moe", tp=2, ep=2, m=2, **FSDP),
        "resume_tp2_fsdp2": dict(tp=2, load=ckpt, m=2, **FSDP),
        "resume_zero1_dp4": dict(data_parallel="zero1", load=ckpt),
        "resume_pp2_fsdp2": dict(pp=2, dp_shard=2, pp_schedule="1f1b", load=ckpt, m=2, **FSDP),
    }
    return {name: {**spec, "refs": refs} for name, spec in cases.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    refs = {}
    for kind in ("dense", "moe"):
        args = _args(kind)
        pcfg = ParallelConfig()
        ref = train_steps(full_model(args), ParallelDims.from_config(pcfg, 1), pcfg, global_batches(args),
                          TrainingConfig(micro_batch=2, grad_clip=1.0), opt_cfg=MUON)  # fmt: skip
        refs[kind] = {
            "losses": ref.losses,
            "norms": ref.grad_norms,
            "state": ref.state,
            "momentum": _momentum(ref),
        }
    ckpt = str(tmp_path_factory.mktemp("muon_ckpt") / "fsdp4")
    return run_layouts(tmp_path_factory, 4, _layouts(refs, ckpt), muon_case, atol_params=PARAM_ATOL)


@pytest.mark.parametrize("name", ["ddp4", "zero1_dp4", "zero2_dp4", "fsdp4", "hsdp_2x2"])
def test_muon_under_data_parallel_matches_single_process(results, name):
    ranks = _checked(results, name)
    assert all(r["muon"] for r in ranks)
    counts = [r["muon_params"] for r in ranks]
    if name == "zero1_dp4":
        # ZeRO-1 partitions the 28 matrices (4 blocks x wq wk wv wo w1 w2 w3): every rank orthogonalises some.
        assert sum(counts) == 28 and all(c > 0 for c in counts)
    else:
        assert counts == [28] * 4
        assert all(r["dtensor"] == (name not in ("ddp4",)) for r in ranks)
    # zero1 by its partition, ddp and the sharded layouts by owners: the 28 x 10 runs spread, no rank doing them all.
    # hsdp: each replica's two shards split them (its replicas repeat that work rather than send across replicas).
    calls = [r["ns_calls"] for r in ranks]
    replicas = 2 if name == "hsdp_2x2" else 1
    assert sum(calls) == replicas * 28 * STEPS and max(calls) <= 28 * STEPS // 2, calls
    # One bucket holds the tiny model's 28 matrices: per step ddp shares the results in one all_gather, the sharded
    # layouts send shards to the owners and results back in two all_to_alls; zero1 sends nothing (its AdamW
    # broadcasts the parameters itself). Per matrix, the general path would have run 28 broadcasts.
    expected = {"ddp4": {"all_gather": 1}, "zero1_dp4": {}}.get(name, {"all_to_all_single": 2})
    assert all(r["collectives"] == expected for r in ranks), [r["collectives"] for r in ranks]


@pytest.mark.parametrize("name", ["tp2_sp_fsdp2", "pp2_fsdp2", "cp2_fsdp2"])
def test_muon_under_hybrid_layouts_matches_single_process(results, name):
    ranks = _checked(results, name)
    # A pipeline stage steps only its own matrices: two blocks of the four each.
    assert [r["muon_params"] for r in ranks] == ([14] * 4 if name.startswith("pp2") else [28] * 4)


@pytest.mark.parametrize("name", ["moe_ep2_fsdp4", "moe_tp2_ep2_fsdp2"])
def test_muon_orthogonalises_expert_parallel_experts_per_expert(results, name):
    for r in _checked(results, name):
        assert r["expert_mesh"] == ["dp_mod_ep", "ep"]


@pytest.mark.parametrize("name", ["resume_tp2_fsdp2", "resume_zero1_dp4", "resume_pp2_fsdp2"])
def test_muon_checkpoint_saved_under_fsdp_resumes_in_other_layouts(results, name):
    # The loaded momentum buffers are the ones that continue the run: every buffer a rank holds at the end equals
    # the uninterrupted reference's. Fresh buffers (the state not restored) would hold only the last five steps'
    # gradients, the reference's a further 0.95^5 of the first five's.
    for r in results[name]["facts"]:
        assert len(r["momentum"]) == r["muon_params"] > 0, (r["momentum"], r["muon_params"])
        far = {k: d for k, d in r["momentum"].items() if d > MOMENTUM_RTOL}
        assert not far, far
    _checked(results, name)
