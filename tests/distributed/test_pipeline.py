"""Pipeline parallelism: every schedule against the single-process reference (same losses, grad norms and final
weights over 10 steps; first-step gradients; evaluation; the nan fault), plus the stage split, its balance and its
refusals.

Each spawn trains several schedules of one pp size through `train_steps` (tests/distributed/reference.py); rank 0
writes what it measured to a JSON file that the parametrized tests read, so each schedule passes or fails on its own."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from scaletrain.config import FaultConfig, ParallelConfig, TrainingConfig
from scaletrain.models import Transformer
from scaletrain.parallel.layout import resolve_microbatches
from scaletrain.parallel.mesh import ParallelDims
from scaletrain.parallel.parallelize import ParallelModel
from scaletrain.parallel.pipeline import (
    ideal_bubble,
    layers_per_stage,
    pipeline_problems,
    split_model,
)
from scaletrain.resilience.faults import FaultInjector
from tests.distributed.reference import (
    Run,
    check_equivalent,
    full_model,
    global_batches,
    reference_run,
    run_layouts,
    tiny_args,
    train_steps,
)

CPU = torch.device("cpu")
# name -> (schedule, n_layers, micro-batches, global batch). Layer counts are chosen to exercise uneven splits (3
# layers on 2 stages: [2, 1]; 5 on 4: [1, 2, 1, 1]) while keeping the model shallow. The pipeline's gradients equal
# the reference's bit for bit; its one difference is the order in which the grad norm's squares are summed, and a
# rounding difference there grows over 10 steps with depth, as in the reference itself: merely changing its
# micro-batch size from 2 to 4 moves its grad norms by 4e-6 relative at 5 layers, 3e-5 at 6, 1e-4 at 8.
CASES_2 = {
    "gpipe": ("gpipe", 3, 4, 8),
    "1f1b": ("1f1b", 4, 4, 8),
    "interleaved_1f1b": ("interleaved_1f1b", 5, 4, 8),
    # 6 micro-batches: dividing by 6 rounds, so this case fails unless each micro-batch loss is divided before its
    # backward as StepRunner does (the schedule's scale_grads=True divides the summed gradients after: 5e-5 drift).
    "interleaved_zb": ("interleaved_zb", 4, 6, 12),
    "zbv": ("zbv", 4, 4, 8),
    "dualpipev": ("dualpipev", 4, 4, 8),
}
CASES_4 = {"1f1b_pp4": ("1f1b", 4, 4, 8), "interleaved_1f1b_pp4": ("interleaved_1f1b", 8, 4, 8)}
# 8 stages need 8 layers, where the grad norm's summation order alone drifts by 1.5e-5 relative over 10 steps
# (clipping turns it into every update); the step-1 gradients are still held to 1e-6 (_check).
DEEP_RTOL = 3e-5


def _grads(pm: ParallelModel) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for part in pm.parts for k, p in part.named_parameters()}


def pipeline_case(rank: int, world_size: int, spec: tuple) -> dict:
    """Train one schedule on a pipeline over every rank and its reference (the same micro-batches, so that every
    per-micro-batch kernel matches), and measure the pipeline-only promises."""
    schedule, n_layers, m, global_batch = spec
    args = tiny_args(n_layers=n_layers)
    batches = global_batches(args, global_batch)
    first: dict[str, dict] = {}

    def keep_first(into: str):
        def hook(step: int, pm: ParallelModel) -> None:
            if step == 0:
                first[into] = _grads(pm)

        return hook

    ref = reference_run(
        full_model(args), batches, micro_batch=global_batch // m, after_backward=keep_first("ref")
    )
    pcfg = ParallelConfig(pp=world_size, pp_schedule=schedule, pp_virtual_stages=2)
    run = train_steps(
        full_model(args),
        ParallelDims.from_config(pcfg, world_size),
        pcfg,
        batches,
        TrainingConfig(micro_batch=global_batch // m),
        n_microbatches=m,
        after_backward=keep_first("pp"),
    )
    # Step 1, before any drift: each gradient tensor's largest error relative to its largest entry.
    ref_grads = first["ref"]
    grad_rel = max(
        ((g - ref_grads[k]).abs().max() / ref_grads[k].abs().max()).item() for k, g in first["pp"].items()
    )
    eval_sum, count = run.runner.eval_loss_sum(*batches[0])
    ref_eval, _ = ref.runner.eval_loss_sum(*batches[0])
    pipe = run.pm.pipeline
    facts = {
        "grad_rel": grad_rel,
        "eval_rel": abs(eval_sum.item() - ref_eval.item()) / ref_eval.item(),
        "eval_count": count,
        "eval_expected": global_batch * args.max_seq_len,
        "nan_injection": _nan_injection(rank, run, *batches[0]),
        "stages": pipe.stage_ids,
        "layers": [sorted(int(k) for k in mod.layers) for mod in pipe.modules],
        "ends": [(mod.tok_embeddings is not None, mod.output is not None) for mod in pipe.modules],
    }
    return {"run": run, "ref": ref, "facts": facts, **({"rtol": DEEP_RTOL} if n_layers >= 8 else {})}


def _nan_injection(rank: int, run: Run, x: torch.Tensor, y: torch.Tensor) -> list[bool]:
    """The FaultInjector's nan fault under the pipeline (NaN logits on the last stage during step 1): [the fault
    fired, loss NaN, grad norm NaN (on every rank: the guard skips the update everywhere), every local gradient NaN
    (it reached the first stage too), the next step finite again]."""
    fired: list[str] = []
    with tempfile.TemporaryDirectory() as run_dir:
        faults = FaultInjector(
            [FaultConfig(kind="nan", step=1)], rank, Path(run_dir), lambda kind, **kw: fired.append(kind)
        )
        faults.attach(None, run.pm.parts)
        faults.at_step_start(1)
        loss = run.runner.forward_backward(x, y)
        norm = run.runner.clip()
        grads = [p.grad for part in run.pm.parts for p in part.parameters()]
        grads_nan = all(g is not None and g.isnan().all().item() for g in grads)
        faults.at_step_end(1, 0.0)
        run.optimizers.step(skip=True)  # what the guard does with a non-finite step: drop the gradients
        after = run.runner.forward_backward(x, y)
        after_norm = run.runner.clip()
        run.optimizers.step(skip=True)
    finite = after.isfinite().item() and after_norm.isfinite().item()
    return [fired == ["fault_injected"], loss.isnan().item(), norm.isnan().item(), grads_nan, finite]


@pytest.fixture(scope="module")
def results_2(tmp_path_factory):
    return run_layouts(tmp_path_factory, 2, CASES_2, pipeline_case)


@pytest.fixture(scope="module")
def results_4(tmp_path_factory):
    return run_layouts(tmp_path_factory, 4, CASES_4, pipeline_case)


def _check(results: dict, name: str) -> list[dict]:
    ranks = check_equivalent(results, name)
    worst = {k: max(r[k] for r in ranks) for k in ("grad_rel", "eval_rel")}
    print(f"{name}: step-1 grads {worst['grad_rel']:.1e}, eval {worst['eval_rel']:.1e}")
    # Step 1, before any drift: every gradient tensor equals the reference's (error relative to the tensor's largest
    # entry; in practice they are bit-identical). A pipeline that summed micro-batches instead of averaging them would
    # be off by a factor of m, one that split a stage's layers wrongly by far more.
    assert worst["grad_rel"] <= 1e-6
    assert worst["eval_rel"] <= 1e-5 and all(r["eval_count"] == r["eval_expected"] for r in ranks)
    assert all(all(r["nan_injection"]) for r in ranks), [
        r["nan_injection"] for r in ranks
    ]  # see _nan_injection
    return ranks


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


def test_interleaved_on_four_ranks_matches_reference(results_4):
    ranks = _check(results_4, "interleaved_1f1b_pp4")
    assert [r["stages"] for r in ranks] == [[0, 4], [1, 5], [2, 6], [3, 7]]


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
