"""The parallel layout checks and ParallelDims sizes: every problem reported at once, each with its fix."""

from __future__ import annotations

import pytest

from scaletrain.config import ParallelConfig
from scaletrain.errors import ConfigError, UserError
from scaletrain.parallel.layout import validate_parallel
from scaletrain.parallel.mesh import ParallelDims, check_restartable_store
from scaletrain.validate import load_config

MODEL = dict(n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden=128, seq_len=32)


def check(world: int, **fields) -> list[str]:
    return validate_parallel(ParallelConfig(**fields), world, **MODEL)


@pytest.mark.parametrize(
    "world, fields",
    [
        (1, {}),
        (8, {}),
        (8, dict(data_parallel="zero1")),
        (8, dict(data_parallel="fsdp", tp=2, sequence_parallel=True)),
        (8, dict(data_parallel="hsdp", dp_replicate=2, tp=2)),
        (2, dict(tp=2)),  # pure TP: no data-parallel ranks, so the ddp default applies nothing and is fine
        (4, dict(data_parallel="zero2", tp=2)),
    ],
)
def test_valid_layouts_pass(world, fields):
    assert check(world, **fields) == []


def test_product_must_equal_world_size():
    (msg,) = check(8, data_parallel="fsdp", dp_shard=2, tp=2)
    assert "= 4" in msg and "8 processes" in msg and "dp_shard = -1" in msg


def test_rest_of_world_must_divide():
    (msg,) = check(6, pp=4)
    assert "does not divide the world size 6" in msg


def test_dp_replicate_needs_hsdp_and_hsdp_needs_replicas():
    (msg,) = check(4, data_parallel="fsdp", dp_replicate=2)
    assert "needs parallel.data_parallel = 'hsdp'" in msg and "dp_replicate = 1" in msg
    (msg,) = check(4, data_parallel="hsdp")
    assert "use data_parallel = 'fsdp'" in msg


@pytest.mark.parametrize("mode", ["ddp", "zero1"])
def test_ddp_modes_refuse_tp(mode):
    (msg,) = check(4, data_parallel=mode, tp=2)
    assert "DDP does not handle the DTensor parameters" in msg and "'fsdp' or 'zero2'" in msg


def test_tp_divisibility_names_each_reason():
    problems = validate_parallel(
        ParallelConfig(data_parallel="fsdp", tp=3, sequence_parallel=True),
        3,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=100,
        ffn_hidden=128,
        seq_len=32,
    )
    text = "\n".join(problems)
    assert len(problems) == 5, text
    for what in ("n_heads 4", "n_kv_heads 2", "vocabulary size 100", "ffn_hidden 128", "seq_len 32"):
        assert what in text
    assert "whole query heads" in text and "vocabulary rows" in text


def test_tp_refuses_tied_embeddings():
    problems = validate_parallel(ParallelConfig(data_parallel="fsdp", tp=2), 2, **MODEL, tie_embeddings=True)
    assert len(problems) == 1 and "tie_embeddings = false" in problems[0]


def test_sequence_parallel_splits_each_cp_ranks_tokens():
    problems = validate_parallel(
        ParallelConfig(data_parallel="fsdp", tp=4, cp=2, sequence_parallel=True),
        8,
        n_heads=4,
        n_kv_heads=4,
        vocab_size=128,
        ffn_hidden=128,
        seq_len=20,
    )
    assert len(problems) == 1 and "the 10 tokens per cp rank" in problems[0]


def test_sequence_parallel_needs_tp():
    (msg,) = check(2, sequence_parallel=True)
    assert "needs tp > 1" in msg


def test_every_problem_at_once():
    problems = check(4, data_parallel="ddp", dp_replicate=2, dp_shard=1, tp=3, sequence_parallel=False)
    # Product 6 != 4; dp_replicate without hsdp; ddp with tp over 2 dp ranks; tp 3 divides none of heads/kv/vocab/ffn.
    assert len(problems) == 7, problems


def test_bad_sizes_are_reported_not_crashing():
    problems = check(4, tp=0, dp_shard=0)
    assert any("parallel.tp must be >= 1" in p for p in problems)
    assert any("parallel.dp_shard must be >= 1 or -1" in p for p in problems)


def test_from_config_resolves_rest_and_raises_on_bad_sizes():
    dims = ParallelDims.from_config(ParallelConfig(data_parallel="hsdp", dp_replicate=2, tp=2), 16)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.world_size, dims.dp_size) == (2, 4, 2, 16, 8)
    assert dims.size("dp_shard_cp") == 4 and dims.size("dp_cp") == 8
    with pytest.raises(ConfigError, match="does not divide"):
        ParallelDims.from_config(ParallelConfig(tp=3), 4)


def test_one_process_needs_no_mesh():
    dims = ParallelDims.from_config(ParallelConfig(), 1)
    assert dims.build_mesh("cpu") is None
    assert dims.submesh("dp_cp") is None and dims.dp_rank == 0 and dims.dp_size == 1
    assert not (dims.tp_enabled or dims.dp_size > 1 or dims.pp_enabled or dims.cp_enabled)


def test_a_worker_torchrun_could_restart_into_a_hang_is_refused():
    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "2"}
    with pytest.raises(UserError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        check_restartable_store(shared)
    check_restartable_store({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"})  # no restarts: nothing to go wrong
    check_restartable_store({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"})  # a fresh store per attempt
    check_restartable_store({})  # not under torchrun


def test_the_whole_config_check_sees_the_resolved_model_and_the_step_s_micro_batches():
    # n_heads 4 comes from the debug preset, n_kv_heads 1 from the override: tp must divide the resolved values.
    with pytest.raises(ConfigError) as e:
        load_config(
            None, ["--parallel.tp", "2", "--parallel.data_parallel", "fsdp", "--model.n_kv_heads", "1"], 2
        )
    assert e.value.problems == [
        "parallel.tp = 2 does not divide model.n_kv_heads 1 (each rank needs whole key/value heads for its share "
        "of query heads); choose a tp that divides it"
    ]
    # pp_microbatches 0: one micro-batch per training.micro_batch sequences of the local batch, as the step counts.
    pp = ["--parallel.pp", "2", "--parallel.data_parallel", "fsdp", "--training.global_batch", "8"]
    load_config(None, [*pp, "--training.micro_batch", "4"], world_size=2)  # 2 micro-batches for 2 stages
    with pytest.raises(ConfigError, match="1f1b needs at least as many micro-batches as stages: 1 < 2"):
        load_config(None, [*pp, "--training.micro_batch", "8"], world_size=2)


def test_pipeline_x_context_parallel_needs_sharded_data_parallel():
    # cp ranks are data-parallel ranks for the gradients, and DDP cannot run inside pipeline stages.
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--parallel.pp", "2", "--parallel.cp", "2"], world_size=4)
    assert any("use data_parallel fsdp, zero2 or hsdp" in p for p in e.value.problems), e.value.problems
    cfg = load_config(
        None, ["--parallel.pp", "2", "--parallel.cp", "2", "--parallel.data_parallel", "fsdp"], world_size=4
    )
    assert (cfg.parallel.pp, cfg.parallel.cp) == (2, 2)


# -- Mixture of experts and expert parallel (tests/distributed/test_expert_parallel.py trains what passes) ---------


def moe_check(world: int, n_experts: int = 8, **fields) -> list[str]:
    return validate_parallel(ParallelConfig(**fields), world, **MODEL, n_experts=n_experts)


@pytest.mark.parametrize(
    "world, fields",
    [
        (4, dict(data_parallel="fsdp", ep=2)),
        (4, dict(data_parallel="fsdp", ep=4)),
        (4, dict(data_parallel="fsdp", pp=2, ep=2)),
        (4, dict(data_parallel="ddp")),  # MoE without expert parallel: any data-parallel mode
        (4, dict(data_parallel="fsdp", tp=2, ep=2)),  # dense layers split over tp, MoE blocks replicated
    ],
)
def test_expert_parallel_layouts_pass(world, fields):
    assert moe_check(world, **fields) == []


@pytest.mark.parametrize(
    "world, n_experts, fields, words",
    [
        (4, 6, dict(data_parallel="fsdp", ep=4), "must divide moe.n_experts 6"),
        (4, 8, dict(data_parallel="fsdp", dp_shard=2, pp=2, ep=4), "must divide it, but dp_shard = 2"),
        (4, 0, dict(data_parallel="fsdp", ep=2), "this model is dense (n_experts = 0)"),
        (4, 8, dict(data_parallel="ddp", ep=2), "needs parallel.data_parallel = 'fsdp'"),
        (4, 8, dict(data_parallel="zero2", ep=2), "'zero2' is not supported with expert parallel"),
        (4, 8, dict(data_parallel="fsdp", cp=2), "balance loss and expert capacity are computed per whole"),
        (4, 8, dict(ep=0), "parallel.ep must be >= 1"),
    ],
)
def test_expert_parallel_refusals_name_the_reason(world, n_experts, fields, words):
    (msg,) = moe_check(world, n_experts, **fields)
    assert words in msg, msg


def test_hsdp_with_expert_parallel_is_refused():
    problems = moe_check(8, data_parallel="hsdp", dp_replicate=2, ep=2)
    assert any("'hsdp' is not supported with expert parallel" in p for p in problems), problems


def test_expert_parallel_is_carved_from_dp_shard():
    dims = ParallelDims.from_config(ParallelConfig(data_parallel="fsdp", pp=2, ep=2), 8)
    assert (dims.world_size, dims.dp_shard, dims.ep) == (8, 4, 2)
    assert (dims.size("ep"), dims.size("dp_mod_ep")) == (2, 2)
    assert dims.describe(ParallelConfig(data_parallel="fsdp", pp=2, ep=2)).endswith("(fsdp, 1f1b, ep2)")
    assert ParallelDims.from_config(ParallelConfig(), 1).submesh("ep") is None


def test_the_whole_config_check_refuses_expert_parallel_on_a_dense_model():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--parallel.ep", "2", "--parallel.data_parallel", "fsdp"], world_size=2)
    assert any("this model is dense" in p for p in e.value.problems), e.value.problems
    cfg = load_config("configs/debug_moe.toml", ["--parallel.ep", "2", "--parallel.data_parallel", "fsdp"], 2)
    assert cfg.parallel.ep == 2


def test_a_layout_problem_is_reported_with_the_configs_other_problems():
    # Two unrelated mistakes: the layout's (ep on a dense model) is not held back until the other one is fixed.
    with pytest.raises(ConfigError) as e:
        load_config(
            None,
            ["--parallel.ep", "2", "--parallel.data_parallel", "fsdp", "--training.eval_interval", "5"]
            + ["--data.val_fraction", "0"],
            world_size=2,
        )
    assert any("this model is dense" in p for p in e.value.problems), e.value.problems
    assert any("needs held-out data" in p for p in e.value.problems), e.value.problems
