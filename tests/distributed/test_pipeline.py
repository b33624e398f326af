"""Pipeline parallelism: every schedule against the single-process reference (same losses, grad norms and final
weights over 10 steps; first-step gradients), plus the stage split, its balance and its refusals.

Each spawn trains several schedules of one pp size; rank 0 writes what it measured to a JSON file that the
parametrized tests read, so each schedule passes or fails on its own (the pattern of test_data_parallel)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from scaletrain.models import Transformer
from scaletrain.optim import build_lr_scheduler, build_optimizer
from scaletrain.parallel.pipeline import (
    apply_pp,
    clip_grad_norm_pp,
    ideal_bubble,
    layers_per_stage,
    pipeline_loss,
    pipeline_problems,
    resolve_microbatches,
    split_model,
)
from tests.distributed.reference import (
    OPT,
    assert_close_run,
    full_model,
    global_batches,
    reference_run,
    tiny_args,
)
from tests.distributed.spawn import spawn

CPU = torch.device("cpu")
# name -> (schedule, n_layers, micro-batches, global batch). Layer counts are chosen to exercise uneven splits (3 layers on 2
# stages: [2, 1]; 5 on 4: [1, 2, 1, 1]) while keeping the model shallow. The pipeline's gradients equal the
# reference's bit for bit; its one difference is the order in which the grad norm's squares are summed, and a
# rounding difference there grows over 10 steps with depth, as in the reference itself: merely changing its
# micro-batch size from 2 to 4 moves its grad norms by 4e-6 relative at 5 layers, 3e-5 at 6, 1e-4 at 8.
CASES_2 = {
    "gpipe": ("gpipe", 3, 4, 8),
    "1f1b": ("1f1b", 4, 4, 8),
    "interleaved_1f1b": ("interleaved_1f1b", 5, 4, 8),
    # 6 micro-batches: dividing by 6 rounds, so this case fails unless each micro-batch loss is divided before its
    # backward as train_step does (the schedule's scale_grads=True divides the summed gradients after: 5e-5 drift).
    "interleaved_zb": ("interleaved_zb", 4, 6, 12),
    "zbv": ("zbv", 4, 4, 8),
    "dualpipev": ("dualpipev", 4, 4, 8),
}
CASES_4 = {"1f1b_pp4": ("1f1b", 4, 4, 8)}


def _first_step_grads(model: Transformer, x: torch.Tensor, y: torch.Tensor, micro_batch: int) -> dict:
    """The reference's gradients of step 1 before clipping: train_step's (loss / n).backward() per micro-batch."""
    model = copy.deepcopy(model)
    xs, ys = x.split(micro_batch), y.split(micro_batch)
    for xm, ym in zip(xs, ys):
        (pipeline_loss(model(xm), ym) / len(xs)).backward()
    return {k: p.grad for k, p in model.named_parameters()}


def _eval_sum_reference(args, state: dict, x: torch.Tensor, y: torch.Tensor) -> float:
    model = full_model(args)
    model.load_state_dict(state)
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").item()


def _train_case(
    rank: int, world_size: int, mesh, schedule: str, n_layers: int, m: int, global_batch: int
) -> dict:
    args = tiny_args(n_layers=n_layers)
    model = full_model(args)
    batches = global_batches(args, global_batch)
    # The reference splits the batch into the same micro-batches, so that every per-micro-batch kernel matches.
    ref = reference_run(model, batches, micro_batch=global_batch // m)
    ref_grads = _first_step_grads(model, *batches[0], global_batch // m)

    parts = apply_pp(model, mesh, schedule=schedule, n_microbatches=m, virtual_stages=2, device=CPU)
    opt = build_optimizer(parts.modules, OPT, CPU)
    sched = build_lr_scheduler(opt, OPT, len(batches))
    losses, norms, grad_diff = [], [], 0.0
    for step, (x, y) in enumerate(batches):
        # Every pp rank feeds the whole batch; only the first stage reads inputs and the last the targets.
        loss = parts.step(x, y)
        if step == 0:
            for mod in parts.modules:
                for k, p in mod.named_parameters():
                    err = (p.grad - ref_grads[k]).abs().max() / ref_grads[k].abs().max()
                    grad_diff = max(grad_diff, err.item())
        norm = clip_grad_norm_pp(parts.modules.parameters(), 1.0, mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
        norms.append(norm.item())

    eval_sum, count = parts.eval_sum(*batches[0])
    states = [None] * world_size
    dist.all_gather_object(states, parts.state_dict())
    merged: dict = {}
    for s in states:
        assert not merged.keys() & s.keys(), "two ranks hold the same parameter"
        merged.update(s)
    error = None
    try:
        assert set(merged) == set(ref["state"]), "the stages' parameter names differ from the full model's"
        assert_close_run(losses, norms, merged, ref, rtol=1e-5)
    except AssertionError as e:
        error = f"rank {rank}: {e}"
    ref_eval = _eval_sum_reference(args, ref["state"], *batches[0])
    return {
        "error": error,
        "nan_injection": _nan_injection(parts, mesh, *batches[0]),
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"])),
        "norm_rel": max(abs(a - b) / abs(b) for a, b in zip(norms, ref["grad_norms"])),
        "param_abs": max((merged[k] - v).abs().max().item() for k, v in ref["state"].items()),
        "grad_rel": grad_diff,
        "eval_rel": abs(eval_sum.item() - ref_eval) / ref_eval,
        "eval_count": count,
        "eval_expected": global_batch * args.max_seq_len,
        "stages": parts.stage_ids,
        "layers": [sorted(int(k) for k in mod.layers) for mod in parts.modules],
        "ends": [(mod.tok_embeddings is not None, mod.output is not None) for mod in parts.modules],
    }


def _nan_injection(parts, mesh, x: torch.Tensor, y: torch.Tensor) -> list[bool]:
    """Fault injection's NaN loss factor under the pipeline: [loss NaN, grad norm NaN (on every rank: the guard skips
    the update everywhere), every local gradient NaN (it reached the first stage too), next step finite again]."""
    loss = parts.step(x, y, loss_factor=float("nan"))
    norm = clip_grad_norm_pp(parts.modules.parameters(), 1.0, mesh)
    grads_nan = all(p.grad.isnan().all().item() for p in parts.modules.parameters() if p.grad is not None)
    for p in parts.modules.parameters():
        p.grad = None
    after = parts.step(x, y)
    for p in parts.modules.parameters():
        p.grad = None
    return [loss.isnan().item(), norm.isnan().item(), grads_nan, after.isfinite().item()]


def pipeline_worker(rank: int, world_size: int, cases: dict, out: str) -> None:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    results = {}
    for name, case in cases.items():
        mine = _train_case(rank, world_size, mesh, *case)
        every = [None] * world_size
        dist.all_gather_object(every, mine)
        results[name] = {
            "error": next((r["error"] for r in every if r["error"]), None),
            "nan_injection": [r["nan_injection"] for r in every],
            **{
                k: max(r[k] for r in every)
                for k in ("loss_rel", "norm_rel", "param_abs", "grad_rel", "eval_rel")
            },
            "eval_count": every[0]["eval_count"],
            "eval_expected": every[0]["eval_expected"],
            "per_rank": [{k: r[k] for k in ("stages", "layers", "ends")} for r in every],
        }
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def _run(tmp_path_factory, world_size: int, cases: dict) -> dict:
    out = tmp_path_factory.mktemp(f"pp{world_size}") / "results.json"
    spawn(pipeline_worker, world_size, cases, str(out))
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def results_2(tmp_path_factory):
    return _run(tmp_path_factory, 2, CASES_2)


@pytest.fixture(scope="module")
def results_4(tmp_path_factory):
    return _run(tmp_path_factory, 4, CASES_4)


def _check(results: dict, name: str) -> list[dict]:
    r = results[name]
    print(
        f"{name}: max relative diff loss {r['loss_rel']:.1e}, grad norm {r['norm_rel']:.1e}, step-1 grads "
        f"{r['grad_rel']:.1e}, eval {r['eval_rel']:.1e}; max abs param diff {r['param_abs']:.1e}"
    )
    assert r["error"] is None, r["error"]
    # Step 1, before any drift: every gradient tensor equals the reference's (error relative to the tensor's largest
    # entry; in practice they are bit-identical). A pipeline that summed micro-batches instead of averaging them would
    # be off by a factor of m, one that split a stage's layers wrongly by far more.
    assert r["grad_rel"] <= 1e-6
    assert r["eval_rel"] <= 1e-5 and r["eval_count"] == r["eval_expected"]
    assert all(all(flags) for flags in r["nan_injection"]), r["nan_injection"]  # see _nan_injection
    return r["per_rank"]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_single_stage_schedules_match_reference(results_2, name):
    ranks = _check(results_2, name)
    assert [r["stages"] for r in ranks] == [[0], [1]]
    assert [r["ends"] for r in ranks] == [[[True, False]], [[False, True]]]
    if name == "gpipe":
        # 3 layers on 2 stages: the extra layer goes to the first stage (the last one also runs output and loss).
        assert [r["layers"] for r in ranks] == [[[0, 1]], [[2]]]


@pytest.mark.parametrize("name", ["interleaved_1f1b", "interleaved_zb"])
def test_interleaved_schedules_match_reference(results_2, name):
    ranks = _check(results_2, name)
    # Looped placement: stage s on rank s % pp.
    assert [r["stages"] for r in ranks] == [[0, 2], [1, 3]]
    if name == "interleaved_1f1b":
        # 5 layers on 4 stages: the extra layer goes to a middle stage, not to the ends.
        assert [r["layers"] for r in ranks] == [[[0], [3]], [[1, 2], [4]]]


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_v_schedules_match_reference(results_2, name):
    ranks = _check(results_2, name)
    # V placement: rank r holds stages r and 2p-1-r, so rank 0 holds both the embedding and the output.
    assert [r["stages"] for r in ranks] == [[0, 3], [1, 2]]
    assert ranks[0]["ends"] == [[True, False], [False, True]]
    assert ranks[1]["ends"] == [[False, False], [False, False]]


def test_1f1b_on_four_ranks_matches_reference(results_4):
    ranks = _check(results_4, "1f1b_pp4")
    assert [r["stages"] for r in ranks] == [[0], [1], [2], [3]]


# Stage split, balance and refusals: single process.


@pytest.mark.parametrize(
    "n_layers,n_stages,expected",
    [
        (8, 4, [2, 2, 2, 2]),
        (5, 2, [3, 2]),
        (6, 4, [1, 2, 2, 1]),
        (7, 4, [2, 2, 2, 1]),
        (10, 4, [2, 3, 3, 2]),
        (4, 4, [1, 1, 1, 1]),
    ],
)
def test_layers_are_balanced_with_lighter_ends(n_layers, n_stages, expected):
    assert layers_per_stage(n_layers, n_stages) == expected


@pytest.mark.parametrize("style,virtual,pp", [("loop", 2, 2), ("v", 2, 2), ("loop", 1, 3)])
def test_split_covers_the_model_and_chains_to_its_output(style, virtual, pp):
    torch.manual_seed(0)
    model = full_model(tiny_args(n_layers=6))
    stages = dict(s for r in range(pp) for s in split_model(model, r, pp, virtual, style))
    assert sorted(stages) == list(range(pp * virtual))
    full = model.state_dict()
    seen: dict = {}
    for mod in stages.values():
        sd = mod.state_dict()
        assert not seen.keys() & sd.keys()
        seen.update(sd)
        for k, v in sd.items():  # copies with the full model's names and values, not views of its storage
            assert torch.equal(v, full[k]) and v.data_ptr() != full[k].data_ptr()
    assert seen.keys() == full.keys()
    x = torch.randint(0, 128, (2, 16))
    h = x
    for s in sorted(stages):
        h = stages[s](h)
    torch.testing.assert_close(h, model(x), rtol=0, atol=0)


def test_v_placement_and_meta_split():
    model = Transformer(tiny_args(n_layers=4))
    model.to(torch.device("meta"))
    (s0, m0), (s3, m3) = split_model(model, 0, 2, 2, "v")
    assert (s0, s3) == (0, 3) and m0.tok_embeddings is not None and m3.output is not None
    assert m0.output is None and m3.tok_embeddings is None and list(m3.layers) == ["3"]
    # A meta stage materialises on its own; init_weights recomputes the RoPE table.
    m3.to_empty(device="cpu")
    m3.init_weights(CPU)
    assert torch.equal(m3.rope, full_model(tiny_args(n_layers=4)).rope)


def test_split_refusals():
    model = full_model(tiny_args(n_layers=3))
    with pytest.raises(ValueError, match="3 layers but the pipeline needs 4 stages"):
        split_model(model, 0, 2, 2, "loop")
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        split_model(full_model(tiny_args(n_layers=6)), 0, 2, 3, "v")
    with pytest.raises(ValueError, match="tie_embeddings"):
        split_model(full_model(tiny_args(tie_embeddings=True)), 0, 2, 1, "loop")


@pytest.mark.parametrize(
    "schedule,pp,m,kw,match",
    [
        ("1f1b", 4, 2, {}, "at least as many micro-batches as stages: 2 < 4"),
        ("interleaved_1f1b", 2, 5, {}, "use 4 or 6"),
        ("interleaved_zb", 4, 9, {}, "use 8 or 12"),
        ("dualpipev", 2, 3, {}, "3 < 4"),
        ("gpipe", 2, 4, {"local_batch": 6}, "6 sequences does not split into 4"),
        ("zbv", 4, 8, {"n_layers": 6}, "6 layers but zbv with pp=4 needs 8 stages"),
        ("interleaved_1f1b", 2, 4, {"n_layers": 3}, "lower parallel.pp or parallel.pp_virtual_stages"),
        ("1f1b", 2, 4, {"tie_embeddings": True}, "tie_embeddings false"),
        ("1f1b", 2, 4, {"data_parallel": "ddp", "dp": 2}, "use data_parallel fsdp"),
        ("pipedream", 2, 4, {}, "unknown"),
    ],
)
def test_pipeline_problems_name_the_fix(schedule, pp, m, kw, match):
    problems = pipeline_problems(schedule, pp, 2, m, **kw)
    assert any(match in p for p in problems), problems


def test_valid_pipelines_have_no_problems():
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"):
        assert pipeline_problems(schedule, 2, 2, 4, n_layers=4, local_batch=8) == []
    assert pipeline_problems("interleaved_1f1b", 4, 2, 3, n_layers=8) == []  # fewer than pp: one round


def test_microbatches_and_ideal_bubble():
    assert resolve_microbatches(0, 32, 8) == 4 and resolve_microbatches(6, 32, 8) == 6
    assert ideal_bubble(2, 4) == pytest.approx(1 / 5)  # (p-1)/(m+p-1)
    assert ideal_bubble(4, 8, 2) == pytest.approx(3 / 19)  # (p-1)/(v·m+p-1)
