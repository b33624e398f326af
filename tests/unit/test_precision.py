"""precision.compute on one process: the loss scaler's growth, backoff and checkpointed state; which mechanism each
layout gets; the checks before launch (fp8 off fp8 hardware, the FSDP-only switches); the CPU warning; fp8's choice
of layers; and an fp16 step whose gradient overflows, skipped by StepRunner without the guard counting it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp

from scaletrain.config import (
    Config,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    ResilienceConfig,
    TrainingConfig,
)
from scaletrain.config.io import to_dict
from scaletrain.errors import ConfigError
from scaletrain.job import build_core
from scaletrain.models import ModelArgs, build_model
from scaletrain.parallel.mesh import DistEnv, ParallelDims
from scaletrain.parallel.parallelize import parallelize
from scaletrain.precision import (
    LossScaler,
    apply_fp8,
    cpu_precision_warning,
    fp8_problems,
    mfu_precision,
    resolve_precision,
)
from scaletrain.resilience.guard import Guard
from scaletrain.run.resume import resume_problems
from scaletrain.validate import load_config

CPU = torch.device("cpu")


def test_scaler_halves_on_overflow_and_doubles_after_clean_steps():
    s = LossScaler(init_scale=8.0, growth_interval=3)
    assert [s.update(True, True) for _ in range(2)] == [False, False] and s.scale == 8.0
    assert s.update(True, False) is True  # an overflow: skip, halve, restart the clean count
    assert (s.scale, s.skipped, s.growth_tracker) == (4.0, 1, 0)
    for _ in range(3):
        assert s.update(True, True) is False
    assert (s.scale, s.growth_tracker) == (8.0, 0)
    assert s.metrics() == {"loss_scale": 8.0, "overflow_skipped": 1}


def test_what_no_scale_can_cure_is_left_to_the_guard():
    s = LossScaler(init_scale=4.0, min_scale=2.0)
    assert s.update(False, False) is False and s.scale == 4.0  # a non-finite loss: the forward itself broke
    assert s.update(True, False) is True and s.scale == 2.0
    assert s.update(True, False) is False and s.scale == 2.0 and s.skipped == 1  # at the floor already
    with pytest.raises(ValueError, match="growth_interval"):
        LossScaler(growth_interval=0)


def test_scaler_state_round_trips_through_a_checkpoint(tmp_path):
    s = LossScaler(init_scale=1024.0, growth_interval=5)
    for finite in (True, True, False, True, True):
        s.update(True, finite)
    dcp.save({"scaler": s}, checkpoint_id=str(tmp_path))
    fresh = LossScaler()
    dcp.load({"scaler": fresh}, checkpoint_id=str(tmp_path))
    assert (fresh.scale, fresh.growth_tracker, fresh.skipped) == (512.0, 2, 1)


def test_scaling_and_unscaling_by_a_power_of_two_are_exact():
    s = LossScaler(init_scale=2.0**16)
    g = torch.randn(1000)
    scaled = s.scale_loss(g)
    s.unscale_([scaled])
    assert torch.equal(scaled, g)
    inf = torch.tensor([1.0, math.inf])
    s.unscale_([inf])
    assert math.isinf(inf[1])


def test_each_layout_gets_its_mechanism():
    bf16 = PrecisionConfig(compute="bf16")
    on_fsdp, on_ddp = resolve_precision(bf16, True, "cpu"), resolve_precision(bf16, False, "cpu")
    assert on_fsdp.mechanism == "fsdp" and on_ddp.mechanism == "autocast"
    mp = on_fsdp.mp_policy()
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert isinstance(on_fsdp.autocast(), type(resolve_precision(PrecisionConfig(), True, "cpu").autocast()))
    assert on_ddp.mp_policy() is None and on_ddp.autocast().fast_dtype == torch.bfloat16
    forced = resolve_precision(PrecisionConfig(compute="bf16", mechanism="autocast"), True, "cpu")
    assert forced.mechanism == "autocast" and forced.mp_policy() is None
    fp32 = resolve_precision(PrecisionConfig(), True, "cpu")
    assert fp32.mechanism == "none" and fp32.mp_policy() is None and fp32.scaler is None
    reduced = resolve_precision(PrecisionConfig(reduce_dtype="bf16"), True, "cpu").mp_policy()
    assert (reduced.param_dtype, reduced.reduce_dtype) == (None, torch.bfloat16)
    fp16 = resolve_precision(PrecisionConfig(compute="fp16", loss_scale_init=256.0), False, "cpu")
    assert fp16.scaler.scale == 256.0 and "loss scale" in fp16.describe()
    assert mfu_precision("fp16", "cuda") == "bf16" and mfu_precision("fp16", "cpu") == "fp32"
    assert mfu_precision("fp8", "cuda") == "bf16"


def _problems(*overrides: str, world_size: int = 1) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--data.seq_len", "64", "--training.global_batch", "8", *overrides], world_size)
    return e.value.problems


def test_fp8_is_refused_before_launch_off_fp8_hardware():
    (msg,) = _problems("--precision.compute", "fp8", "--training.device", "cpu")
    assert "needs a CUDA GPU with compute capability >= 8.9" in msg and "this run is on cpu" in msg
    with_qat = _problems(
        "--precision.compute", "fp8", "--training.device", "cpu", "--precision.qat", "int8_int4"
    )
    assert len(with_qat) == 2 and any("both replace the blocks' Linear layers" in p for p in with_qat)
    (old,) = fp8_problems("cuda", capability=(8, 0))
    assert "this GPU has 8.0" in old
    assert any("parallel.tp > 1" in p for p in fp8_problems("cuda", tp=2, capability=(9, 0)))
    assert fp8_problems("cuda", capability=(9, 0)) == []


def test_fsdp_only_switches_are_refused_where_fsdp_does_not_wrap():
    got = _problems("--precision.compute", "bf16", "--precision.mechanism", "fsdp", "--precision.reduce_dtype",
                    "bf16")  # fmt: skip
    assert len(got) == 2 and "use auto or autocast" in got[0] and "leave it fp32" in got[1]
    load_config(None, ["--precision.compute", "bf16", "--precision.mechanism", "fsdp",
                       "--parallel.data_parallel", "fsdp", "--precision.reduce_dtype", "bf16"], world_size=2)  # fmt: skip
    (scale,) = _problems("--precision.compute", "fp16", "--precision.loss_scale_growth_interval", "0")
    assert "loss_scale_growth_interval >= 1" in scale


def test_switching_to_fp16_on_resume_is_refused():
    saved, new = Config(), Config()
    new.precision.compute = "fp16"
    (msg,) = [p for p in resume_problems(to_dict(saved), to_dict(new), ["precision"]) if "loss-scaler" in p]
    assert "new --run.dir" in msg
    back = Config()
    back.precision.compute = "fp16"
    assert resume_problems(to_dict(back), to_dict(saved), ["precision.compute"]) == []
    assert (
        resume_problems(to_dict(back), to_dict(saved), ["training.precision"]) == []
    )  # named by its old name


def test_cpu_without_bf16_units_warns_with_the_reason():
    msg = cpu_precision_warning("bf16", "cpu", flags={"avx2", "fma"})
    assert "no amx_bf16 or avx512_bf16" in msg and "3-4x slower" in msg and "--precision.compute fp32" in msg
    assert "fp16" in cpu_precision_warning("fp16", "cpu", flags={"avx2"})
    assert cpu_precision_warning("bf16", "cpu", flags={"avx512_bf16"}) is None
    assert cpu_precision_warning("bf16", "cpu", flags={"amx_bf16"}) is None
    assert cpu_precision_warning("bf16", "cuda", flags=set()) is None
    assert cpu_precision_warning("fp32", "cpu", flags=set()) is None


def test_fp8_swaps_the_block_linears_and_keeps_the_output_projection():
    pytest.importorskip("torchao.float8")
    args = ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=128, max_seq_len=16
    )
    precision = resolve_precision(PrecisionConfig(compute="fp8", fp8_recipe="rowwise"), False, "cuda")
    pm = parallelize(build_model(args, 0, CPU), ParallelDims(), ParallelConfig(), device=CPU, n_microbatches=1,
                     precision=precision)  # fmt: skip
    kinds = {
        name: type(m).__name__ for name, m in pm.parts[0].named_modules() if "Linear" in type(m).__name__
    }
    assert kinds.pop("output") == "Linear"
    assert len(kinds) == 14 and set(kinds.values()) == {"Float8Linear"}
    # Sizes torch._scaled_mm cannot take (not multiples of 16) stay in bf16.
    odd = apply_fp8(build_model(ModelArgs(**{**args.__dict__, "ffn_hidden": 40}), 0, CPU), "tensorwise")
    ffn = odd.layers["0"].feed_forward
    assert type(ffn.w1).__name__ == "Linear" and type(odd.layers["0"].attention.wq).__name__ == "Float8Linear"


def _fp16_step_setup(tmp_path):
    args = ModelArgs(
        dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=64, vocab_size=64, max_seq_len=16
    )
    model = build_model(args, 0, CPU)
    tcfg = TrainingConfig(micro_batch=2, steps=10)
    precision = resolve_precision(PrecisionConfig(compute="fp16", loss_scale_init=1024.0), False, "cpu")
    opt = OptimizerConfig(warmup_steps=0)
    pm, optimizers, runner = build_core(model, ParallelDims(), ParallelConfig(), tcfg, opt, device=CPU,
                                        n_microbatches=1, precision=precision)  # fmt: skip
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=CPU)
    events: list = []
    guard = Guard(ResilienceConfig(nan_rollback_after=1), tmp_path, env, None,
                  lambda kind, **kw: events.append(kind), lambda x: x)  # fmt: skip
    return model, runner, optimizers, guard, events


def test_an_fp16_overflow_is_skipped_by_the_scaler_not_counted_by_the_guard(tmp_path):
    model, runner, optimizers, guard, events = _fp16_step_setup(tmp_path)
    fire = [False]
    model.layers["0"].feed_forward.w2.weight.register_hook(lambda g: g * math.inf if fire[0] else g)
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    decisions, scales = [], []
    for step in range(3):
        fire[0] = step == 1
        before = model.output.weight.detach().clone()
        loss = runner.forward_backward(x[:, :-1], x[:, 1:])
        norm = runner.clip()
        # train.py's two lines: the overflow is the scaler's; only a clean step goes to the guard.
        overflow = runner.loss_scale_overflow(loss, norm)
        decision = "skip" if overflow else guard.check(step + 1, loss, norm)
        optimizers.step(skip=decision != "ok")
        decisions.append(decision)
        scales.append(runner.scale_metrics()["loss_scale"])
        assert torch.equal(model.output.weight, before) == (step == 1)
    assert decisions == ["ok", "skip", "ok"] and scales == [1024.0, 512.0, 512.0]
    # nan_rollback_after = 1: had the guard seen the overflow it would have asked for a rollback.
    assert events == [] and guard.nan.skipped_total == 0 and runner.scaler.skipped == 1
