"""bf16 (autocast, and FSDP2's MixedPrecisionPolicy) and fp16 (dynamic loss scaling) follow fp32 over 30 steps,
on one process and under fsdp x 2, pp 2, tp 2 and cp 2; an fp16 overflow injected into one rank's gradient shard skips exactly that step
on every rank, lowers the scale, and a run resumed from a checkpoint taken after it continues bit for bit.

The model is the debug preset's shape scaled down (tiny_args, 2 layers): on this CPU (no bf16 matrix units) the
debug preset itself costs ~0.6 s per bf16 step, which 30 steps of five cases cannot afford. Every loop below is
train.py's: parallelize -> build_step_runner -> forward_backward -> clip -> loss_scale_overflow -> Optimizers.step.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from scaletrain.checkpoint import ModelState
from scaletrain.config import ParallelConfig, PrecisionConfig, TrainingConfig
from scaletrain.job import build_core
from scaletrain.parallel.mesh import ParallelDims, all_reduce_mean
from scaletrain.parallel.parallelize import fsdp_applies
from scaletrain.precision import resolve_precision
from tests.distributed.reference import (
    CPU,
    OPT,
    full_model,
    gather_state,
    run_layouts,
    tiny_args,
)

ARGS = tiny_args(n_layers=2)
STEPS = 30
GLOBAL_BATCH = 4
# The largest relative loss difference from fp32 at any of the 30 steps. bf16 keeps 8 bits of mantissa, fp16 11: the
# losses part by rounding that AdamW then carries forward. Measured (docs/performance.md): bf16 1.3e-3 under the
# FSDP2 policy, 6.7e-4 / 8.1e-4 by autocast (fsdp x 2 / one process); fp16 4.3e-4 / 3.5e-4.
RTOL = {"bf16": 5e-3, "fp16": 2e-3}
OVERFLOW_STEP, SAVE_AFTER, OVERFLOW_STEPS = 3, 5, 9  # 0-based step indices


def markov_batches(steps: int, seed: int = 1) -> list:
    """Sequences a model can learn in 30 steps (random tokens cannot be learnt beyond their uniform entropy): each
    token is 5 x the previous one plus 0-3, modulo the vocabulary, so the loss falls from ln(128) toward ln(4)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.empty(GLOBAL_BATCH, ARGS.max_seq_len + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, ARGS.vocab_size, (GLOBAL_BATCH,), generator=g)
        noise = torch.randint(0, 4, x.shape, generator=g)
        for t in range(1, x.shape[1]):
            x[:, t] = (5 * x[:, t - 1] + noise[:, t]) % ARGS.vocab_size
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def _watch_dtypes(model) -> dict:
    """What wq of block 0 computes with: its weight's dtype inside the forward (FSDP's policy casts it at the
    all-gather; autocast leaves it fp32) and its output's dtype (bf16 under either mechanism)."""
    seen: dict = {}
    wq = model.layers["0"].attention.wq

    def before(module, args) -> None:
        seen.setdefault("weight", str(module.weight.dtype))

    def after(module, args, out) -> None:
        seen.setdefault("output", str(out.dtype))

    wq.register_forward_pre_hook(before)
    wq.register_forward_hook(after)
    return seen


def _inject_inf(model, step_of, at: int, rank: int) -> None:
    """At step `at`, on rank 0 only, put an inf into the gradient of the output projection's last row, as an fp16
    overflow in backward would: a hook on the (unsharded) weight, before FSDP reduce-scatters it. Under fsdp x 2
    that row is rank 1's shard, so only rank 1 holds a non-finite gradient afterwards."""
    if rank != 0:
        return

    def grad_hook(g: torch.Tensor) -> torch.Tensor:
        if step_of() != at:  # the hook stays on the weight; it fires once
            return g
        g = g.clone()
        g[-1, 0] = math.inf
        return g

    def pre(module, args):
        if step_of() == at and torch.is_grad_enabled():
            module.weight.register_hook(grad_hook)

    model.output.register_forward_pre_hook(pre)


def _build(spec: dict, world_size: int, rank: int):
    single = spec["layout"] == "single"
    pcfg = ParallelConfig(**LAYOUTS[spec["layout"]])
    dims = ParallelDims() if single else ParallelDims.from_config(pcfg, world_size)
    if not single and dims.mesh is None:
        dims.build_mesh("cpu")
    m = 2 if pcfg.pp > 1 else 1  # pipeline micro-batches: the schedule's loss_fn carries the fp16 scale
    tcfg = TrainingConfig(micro_batch=GLOBAL_BATCH // dims.dp_size // m)
    prec = PrecisionConfig(
        compute=spec["precision"],
        mechanism=spec.get("mechanism", "auto"),
        loss_scale_init=1024.0,
        loss_scale_growth_interval=spec.get("growth", 2000),
    )
    model = full_model(ARGS)
    seen = _watch_dtypes(model)
    step = {"i": -1}
    if "inject" in spec:
        _inject_inf(model, lambda: step["i"], spec["inject"], rank)
    precision = resolve_precision(prec, fsdp_applies(dims, pcfg.data_parallel), "cpu")
    tcfg = replace(tcfg, steps=spec.get("steps", STEPS))
    pm, optimizers, runner = build_core(model, dims, pcfg, tcfg, OPT, device=CPU, n_microbatches=m,
                                        precision=precision)  # fmt: skip
    state = {"model": ModelState(pm.parts), "optimizer": optimizers, **runner.resumable()}  # as train.py's
    return dims, pm, optimizers, runner, state, seen, step, precision


def _local_nonfinite(pm) -> bool:
    for p in pm.parts[0].parameters():
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if not torch.isfinite(g).all():
                return True
    return False


def _train(spec: dict, world_size: int, rank: int, *, first: int = 0, load: str | None = None) -> dict:
    """Train steps first..steps-1 of the spec's batches; `load`: resume from that checkpoint first; spec "save":
    save one after that step."""
    dims, pm, optimizers, runner, state, seen, step, precision = _build(spec, world_size, rank)
    if load is not None:
        dcp.load(state, checkpoint_id=load, process_group=dims.control)
    batches = markov_batches(spec.get("steps", STEPS))
    local = GLOBAL_BATCH // dims.dp_size
    rows = slice(dims.dp_rank * local, (dims.dp_rank + 1) * local)
    out: dict = {"loss": [], "norm": [], "scale": [], "overflow": [], "nonfinite_local": []}
    for i in range(first, len(batches)):
        step["i"] = i
        x, y = batches[i]
        before = (
            {k: v.clone() for k, v in gather_state(pm, dims).items()} if i == spec.get("inject") else None
        )
        loss = runner.forward_backward(x[rows], y[rows])
        out["nonfinite_local"].append(_local_nonfinite(pm))
        norm = runner.clip()
        overflow = runner.loss_scale_overflow(loss, norm)
        optimizers.step(skip=overflow)
        out["loss"].append(all_reduce_mean(loss, dims.submesh("dp_cp")).item())
        out["norm"].append(norm.item())
        out["overflow"].append(overflow)
        out["scale"].append(runner.scaler.scale if runner.scaler is not None else 1.0)
        if before is not None:
            after = gather_state(pm, dims)
            out["unchanged_by_overflow"] = all(torch.equal(after[k], v) for k, v in before.items())
        if i == spec.get("save"):
            dcp.save(state, checkpoint_id=spec["ckpt"], process_group=dims.control)
    final = gather_state(pm, dims)
    out["final"] = {k: v.double().sum().item() for k, v in final.items()}
    out["final_bits"] = [zlib.crc32(v.numpy().tobytes()) for v in final.values()]
    out["dtypes"] = seen
    out["describe"] = precision.describe()
    out["skipped"] = runner.scaler.skipped if runner.scaler is not None else 0
    return out


def precision_case(rank: int, world_size: int, spec: dict) -> dict:
    if spec["layout"] == "single":  # one rank is enough: the ranks share the work
        return {"facts": _train(spec, world_size, rank) if rank == spec["rank"] else {}}
    if "resume" not in spec:
        return {"facts": _train(spec, world_size, rank)}
    whole = _train(spec, world_size, rank)  # saves after step SAVE_AFTER
    resumed = _train({**spec, "save": None}, world_size, rank, first=SAVE_AFTER + 1, load=spec["ckpt"])
    return {"facts": {"whole": whole, "resumed": resumed}}


# The layouts a case names; pp and tp run with fsdp inside (ddp cannot hold DTensors or run in stages).
LAYOUTS = {
    "single": dict(data_parallel="ddp"),
    "fsdp": dict(data_parallel="fsdp"),
    "pp2": dict(pp=2, pp_schedule="1f1b", data_parallel="fsdp"),
    "tp2": dict(tp=2, data_parallel="fsdp"),
    "cp2": dict(cp=2, data_parallel="fsdp"),  # fsdp over the cp ranks: the FSDP2 policy applies
}
CASES = {
    "single_fp32": dict(layout="single", precision="fp32", rank=0),
    "single_bf16": dict(layout="single", precision="bf16", rank=1),
    "single_fp16": dict(layout="single", precision="fp16", rank=0),
    "fsdp_fp32": dict(layout="fsdp", precision="fp32"),
    "fsdp_bf16_autocast": dict(layout="fsdp", precision="bf16", mechanism="autocast"),
    "fsdp_bf16_policy": dict(layout="fsdp", precision="bf16"),  # auto: the FSDP2 policy
    "fsdp_fp16_policy": dict(layout="fsdp", precision="fp16"),
    "pp2_fp16": dict(layout="pp2", precision="fp16"),
    "pp2_bf16": dict(layout="pp2", precision="bf16"),
    "tp2_fp16": dict(layout="tp2", precision="fp16"),
    "tp2_bf16": dict(layout="tp2", precision="bf16"),
    "cp2_fp16": dict(layout="cp2", precision="fp16"),
    "cp2_bf16": dict(layout="cp2", precision="bf16"),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("precision_ckpt") / "after_overflow")
    overflow = dict(
        layout="fsdp",
        precision="fp16",
        steps=OVERFLOW_STEPS,
        inject=OVERFLOW_STEP,
        growth=4,
        save=SAVE_AFTER,
        ckpt=ckpt,
        resume=True,
    )
    return run_layouts(tmp_path_factory, 2, {**CASES, "fsdp_fp16_overflow": overflow}, precision_case)


def _facts(results: dict, name: str) -> list[dict]:
    r = results[name]
    assert not r["errors"], "\n".join(r["errors"])
    return r["facts"]


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    "name, ref",
    [
        ("single_bf16", "single_fp32"),
        ("single_fp16", "single_fp32"),
        ("fsdp_bf16_autocast", "fsdp_fp32"),
        ("fsdp_bf16_policy", "fsdp_fp32"),
        ("fsdp_fp16_policy", "fsdp_fp32"),
        ("pp2_fp16", "single_fp32"),
        ("pp2_bf16", "single_fp32"),
        ("tp2_fp16", "single_fp32"),
        ("tp2_bf16", "single_fp32"),
        ("cp2_fp16", "single_fp32"),
        ("cp2_bf16", "single_fp32"),
    ],
)
def test_low_precision_losses_follow_fp32(results, name, ref):
    pick = lambda case: next(f for f in _facts(results, case) if f)  # noqa: E731 (a single case's one rank)
    got, want = pick(name), pick(ref)
    rel = _max_rel(got["loss"], want["loss"])
    print(f"{name}: max relative loss difference from {ref} over {STEPS} steps {rel:.2e} ({got['describe']})")
    assert rel <= RTOL[name.split("_")[1]]
    assert rel > 0, "bit-equal to fp32: the low precision was not applied"
    assert want["loss"][-1] < want["loss"][0] - 0.5  # the reference learns, so following it means something
    assert not any(got["overflow"]), "no overflow expected at these scales"


def test_the_mechanisms_cast_what_they_promise(results):
    assert _facts(results, "fsdp_fp32")[0]["dtypes"] == {"weight": "torch.float32", "output": "torch.float32"}
    # Autocast keeps fp32 weights and casts per op; the FSDP2 policy gathers the weights already in bf16.
    assert _facts(results, "fsdp_bf16_autocast")[0]["dtypes"] == {
        "weight": "torch.float32",
        "output": "torch.bfloat16",
    }
    assert _facts(results, "fsdp_bf16_policy")[0]["dtypes"] == {
        "weight": "torch.bfloat16",
        "output": "torch.bfloat16",
    }
    assert _facts(results, "fsdp_fp16_policy")[0]["dtypes"]["weight"] == "torch.float16"
    assert "MixedPrecisionPolicy" in _facts(results, "fsdp_bf16_policy")[0]["describe"]
    assert "autocast" in _facts(results, "single_bf16")[1]["describe"]


def test_fsdp_replicas_agree_on_every_value(results):
    for name in ("fsdp_bf16_policy", "fsdp_fp16_policy"):
        a, b = _facts(results, name)
        assert a["loss"] == b["loss"] and a["final_bits"] == b["final_bits"] and a["scale"] == b["scale"]


def test_an_overflow_skips_that_step_on_every_rank_and_resumes_bit_identically(results):
    ranks = _facts(results, "fsdp_fp16_overflow")
    whole = [r["whole"] for r in ranks]
    # Only rank 1 holds the inf (its shard of the output projection), yet both ranks skip the same step.
    assert [w["nonfinite_local"][OVERFLOW_STEP] for w in whole] == [False, True]
    for w in whole:
        assert [i for i, o in enumerate(w["overflow"]) if o] == [OVERFLOW_STEP]
        assert w["unchanged_by_overflow"], "the skipped step changed the weights"
        assert w["skipped"] == 1 and not math.isfinite(w["norm"][OVERFLOW_STEP])
        # From 1024, growth every 4 clean steps: steps 0-2 are clean, 3 overflows (halved to 512, the count
        # restarts), and 4-7 double it back.
        assert w["scale"][OVERFLOW_STEP - 1] == 1024.0 and w["scale"][OVERFLOW_STEP] == 512.0
        assert w["scale"][OVERFLOW_STEP + 4] == 1024.0
    # A fresh run loaded from the checkpoint saved after step SAVE_AFTER continues as the uninterrupted run did.
    for r in ranks:
        w, res = r["whole"], r["resumed"]
        assert res["loss"] == w["loss"][SAVE_AFTER + 1 :], "the resumed losses differ"
        assert res["scale"] == w["scale"][SAVE_AFTER + 1 :] and res["skipped"] == 1
        assert res["final_bits"] == w["final_bits"] and res["final"] == w["final"]
