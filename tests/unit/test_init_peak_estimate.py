"""The memory check counts sharded initialisation's peak (issue 23 item 2): a rank's share, DDP's buckets and one
parameter drawn whole (parallel/materialize.py), so that no accepted layout runs out of memory before step 1."""

from __future__ import annotations

import functools

import pytest

from scaletrain.config import MemoryConfig, ModelConfig, ParallelConfig, TrainingConfig
from scaletrain.models.init import WHOLE_PARAM_COPIES, trunc_normal_
from scaletrain.models.llama import ModelArgs
from scaletrain.models.presets import build_meta_model, resolve_model_args
from scaletrain.planning.estimators.memory import PARTS, GiB, init_draw_bytes, memory_problem, per_rank_bytes

T = TrainingConfig(micro_batch=1)


def drawn_from_the_plan(args: ModelArgs) -> float:
    """The most bytes one draw of the init plan holds, read off the plan itself (trunc_normal_ holds
    WHOLE_PARAM_COPIES of its tensor, normal_ and ones_ one)."""
    model = build_meta_model(args)
    params = dict(model.named_parameters())
    out = 0.0
    for name, init in model.init_plan():
        copies = (
            WHOLE_PARAM_COPIES if isinstance(init, functools.partial) and init.func is trunc_normal_ else 1
        )
        out = max(out, copies * params[name].nbytes)
    return out


@pytest.mark.parametrize("preset", ["debug", "debug_moe", "125M", "1B", "deepseek_moe_16b"])
def test_the_draw_estimate_is_the_init_plans(preset):
    args = resolve_model_args(ModelConfig(preset=preset), 320, 256)
    assert init_draw_bytes(args) == pytest.approx(drawn_from_the_plan(args))


def test_the_issue_model_under_fsdp_16_counts_a_share_not_a_whole_copy():
    # 28 layers of dim 1024 (0.43B with a 50k vocabulary): 1.6 GiB per rank materialised before sharded init.
    args = ModelArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden=2816, vocab_size=50304)
    e = per_rank_bytes(args, ParallelConfig(data_parallel="fsdp"), T, 256, 16)
    assert e["init"] == pytest.approx(e["parameters"] + init_draw_bytes(args) + e["overhead"])
    # 0.10 GiB of share and 0.43 GiB drawing the output whole (with the sampler's candidate), not the 1.6 GiB model.
    full = sum(p.nbytes for p in build_meta_model(args).parameters())
    assert e["parameters"] == pytest.approx(full / 16) and e["init"] - e["overhead"] < 0.6 * full
    ddp = per_rank_bytes(args, ParallelConfig(data_parallel="ddp"), T, 256, 16)
    assert ddp["init"] >= 2 * ddp["parameters"]  # DDP: the whole model and its gradient buckets


def test_a_layout_whose_initialisation_does_not_fit_is_refused():
    # A large untied vocabulary over 64 ranks, tp 8 x fsdp 8: the share and the gathered tables are split by tp,
    # the output drawn whole is not.
    args = ModelArgs(dim=2048, n_layers=2, n_heads=16, n_kv_heads=8, ffn_hidden=5632, vocab_size=262144)
    fsdp = ParallelConfig(data_parallel="fsdp", tp=8)
    e = per_rank_bytes(args, fsdp, T, 256, 64)
    step = sum(e[k] for k in PARTS)
    assert e["total"] == e["init"] > step
    problem = memory_problem(args, fsdp, T, 256, 64, device_bytes=int(step + 0.5 * GiB))
    assert problem is not None and "at initialisation" in problem
    off = per_rank_bytes(args, fsdp, T, 256, 64, memory=MemoryConfig(optimizer_offload=True))
    assert off["init"] == pytest.approx(init_draw_bytes(args) + off["overhead"])  # the share is on the host
