"""Activation recompute (scaletrain/parallel/recompute.py) on one process: every policy trains bit for bit like no
recompute, recomputes what it promises in backward, saves less than no recompute, and keeps parameter names; the
offload switches are refused before launch where they cannot run."""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.utils._python_dispatch import TorchDispatchMode

from scaletrain.config import MemoryConfig, ParallelConfig, TrainingConfig
from scaletrain.errors import ConfigError
from scaletrain.metrics.memory import saved_activation_bytes
from scaletrain.models.loss import cross_entropy
from scaletrain.parallel.mesh import ParallelDims
from scaletrain.parallel.offload import apply_activation_offload, fsdp_offload_policy, offload_problems
from scaletrain.parallel.recompute import apply_recompute, recomputed_blocks
from scaletrain.planning.estimators.hardware import DEFAULT_CPU
from scaletrain.planning.estimators.time import step_time
from scaletrain.validate import load_config
from tests.distributed.reference import full_model, global_batches, tiny_args, train_steps

POLICIES = ("full", "every_k", "selective", "selective_op")


def _train(mode: str):
    args = tiny_args()
    pcfg = ParallelConfig()
    return train_steps(
        full_model(args),
        ParallelDims.from_config(pcfg, 1),
        pcfg,
        global_batches(args),
        TrainingConfig(micro_batch=4),
        memory=MemoryConfig(recompute=mode, recompute_every=2),
    )


@pytest.fixture(scope="module")
def plain():
    return _train("none")


@pytest.mark.parametrize("mode", POLICIES)
def test_recompute_trains_bitwise_like_no_recompute(plain, mode):
    # fp32 on CPU: the recomputed ops run the same kernels on the same inputs, so everything is bitwise equal.
    run = _train(mode)
    assert run.losses == plain.losses
    assert run.grad_norms == plain.grad_norms
    assert run.state.keys() == plain.state.keys()
    for k, v in plain.state.items():
        assert torch.equal(run.state[k], v), k


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()
        self.mm_flops = 0  # 2 m k n of every aten.mm

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.__name__] += 1
        if func is torch.ops.aten.mm.default:
            (m, k), n = args[0].shape, args[1].shape[1]
            self.mm_flops += 2 * m * k * n
        return func(*args, **(kwargs or {}))


def test_backward_recomputes_what_each_policy_promises():
    """The ops run during backward, beyond plain backward: full re-runs each block's matmuls, attention and
    element-wise ops; selective only the element-wise ops and norms (its matmul outputs are saved)."""
    args = tiny_args()
    base = full_model(args)
    x, y = global_batches(args, global_batch=2, steps=1)[0]
    seen = {}
    for mode in ("none", *POLICIES):
        model = apply_recompute(copy.deepcopy(base), mode, 2)
        loss = cross_entropy(model(x), y)
        with _CountOps() as count:
            loss.backward()
        seen[mode] = count.calls
    attn = "_scaled_dot_product_flash_attention_for_cpu.default"
    mm = seen["none"]["mm.default"]
    for mode, blocks in (("none", 0), ("full", 4), ("every_k", 2), ("selective", 4), ("selective_op", 4)):
        assert seen[mode]["silu.default"] == blocks, mode
        assert seen[mode]["rsqrt.default"] == 2 * blocks, mode  # two RMSNorms per block
    # Non-reentrant checkpoint stops recomputing once backward has what it needs: w2's matmul is not re-run.
    assert seen["full"]["mm.default"] == mm + 6 * 4 and seen["full"][attn] == 4
    assert seen["every_k"]["mm.default"] == mm + 6 * 2
    assert seen["selective"]["mm.default"] == mm and seen["selective"][attn] == 0
    # selective_op (torchtitan's per-op policy) re-runs every second Linear: wk, wo and w3 of each block.
    assert seen["selective_op"]["mm.default"] == mm + 3 * 4 and seen["selective_op"][attn] == 0


def test_the_planners_recompute_for_selective_op_is_the_matmuls_backward_re_runs():
    """The time model's extra recompute for selective_op over selective (at 1 FLOP/s and no fixed cost per
    matmul, its seconds are FLOPs) equals the FLOPs of the matmuls backward runs again, counted by a dispatch mode
    (the tiny shape's q, kv and ffn widths differ, so the wrong Linears would not add up)."""
    args = tiny_args()
    x, y = global_batches(args, global_batch=2, steps=1)[0]
    measured, planned = {}, {}
    profile = dataclasses.replace(DEFAULT_CPU, matmul={"fp32": (0.0, 1.0)}, threads=1, cores=1)
    for mode in ("selective", "selective_op"):
        model = apply_recompute(full_model(args), mode)
        loss = cross_entropy(model(x), y)
        with _CountOps() as count:
            loss.backward()
        measured[mode] = count.mm_flops
        plan = step_time(args, ParallelConfig(), TrainingConfig(micro_batch=2), MemoryConfig(recompute=mode),
                         args.max_seq_len, 1, profile, global_batch=2)  # fmt: skip
        planned[mode] = plan["recompute_s"]
    rerun = measured["selective_op"] - measured["selective"]
    assert rerun > 0 and planned["selective_op"] - planned["selective"] == pytest.approx(rerun, rel=1e-9)


def test_saved_activations_full_below_selective_below_none():
    args = tiny_args(max_seq_len=64)
    base = full_model(args)
    x, y = global_batches(args, global_batch=4, steps=1)[0]
    saved = {}
    for mode in ("none", *POLICIES):
        model = apply_recompute(copy.deepcopy(base), mode, 2)
        saved[mode], loss = saved_activation_bytes(lambda m=model: cross_entropy(m(x), y))
        loss.backward()
    assert saved["full"] < saved["selective_op"] < saved["selective"] < saved["none"]
    assert saved["full"] < saved["every_k"] < saved["none"]


def test_parameter_names_and_state_dicts_do_not_depend_on_the_policy():
    base = full_model(tiny_args())
    names = list(base.state_dict())
    for mode in POLICIES:
        model = apply_recompute(copy.deepcopy(base), mode, 2)
        assert list(model.state_dict()) == names
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in base.named_parameters()]
        other = apply_recompute(full_model(tiny_args(), seed=1), "selective")
        other.load_state_dict(model.state_dict())  # a checkpoint loads across policies
        assert all(torch.equal(a, b) for a, b in zip(other.parameters(), base.parameters()))


def test_every_k_counts_layers_of_the_whole_model():
    assert recomputed_blocks([str(i) for i in range(6)], "every_k", 3) == ["2", "5"]
    assert recomputed_blocks(["4", "5", "6", "7"], "every_k", 2) == ["5", "7"]  # a later pipeline stage
    assert recomputed_blocks(["0", "1"], "none") == []
    with pytest.raises(ValueError, match="unknown recompute mode"):
        recomputed_blocks(["0"], "some")


def _problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--training.device", "cpu", *overrides])
    return e.value.problems


@pytest.mark.parametrize("name", ["activation_offload", "optimizer_offload"])
def test_offload_is_refused_on_cpu_with_the_reason(name):
    (problem,) = _problems(f"--memory.{name}", "true")
    assert f"memory.{name} needs a CUDA device" in problem
    assert "already live in host memory, so there is nothing to offload them to" in problem


def test_recompute_every_must_be_positive():
    assert _problems("--memory.recompute", "every_k", "--memory.recompute_every", "0") == [
        "memory.recompute_every must be >= 1 with recompute every_k, got 0"
    ]


@pytest.mark.parametrize("preset", ["debug_moe", "debug_deepseek_v3"])
def test_selective_op_is_refused_where_its_positions_are_not_a_llama_blocks(preset):
    (problem,) = _problems("--model.preset", preset, "--memory.recompute", "selective_op")
    assert "memory.recompute selective_op is refused with MoE or MLA blocks" in problem
    assert load_config(None, ["--training.device", "cpu", "--memory.recompute", "selective_op"])


def test_offload_decisions_on_cuda_without_cuda():
    on = MemoryConfig(activation_offload=True, optimizer_offload=True)
    assert offload_problems(on, "cuda", "fsdp", fsdp_applied=True) == []
    assert offload_problems(on, "cuda", "hsdp", fsdp_applied=True) == []
    (ddp,) = offload_problems(on, "cuda", "ddp", fsdp_applied=False)
    assert "needs parallel.data_parallel fsdp, zero2 or hsdp (got ddp)" in ddp
    (one,) = offload_problems(on, "cuda", "fsdp", fsdp_applied=False)
    assert "one data-parallel rank" in one
    assert (
        isinstance(fsdp_offload_policy(on), CPUOffloadPolicy) and fsdp_offload_policy(MemoryConfig()) is None
    )
    with pytest.raises(ValueError, match="needs a CUDA device"):
        apply_activation_offload(full_model(tiny_args()), torch.device("cpu"))
