"""training.batch_ramp in one process: the ramp's shape, the learning-rate schedule counted in tokens (and resumed),
ramped steps reading the global stream in order on any number of ranks, a smaller step's gradient being the mean
over its own tokens, throughput from each step's real tokens, and the refusals with their reasons."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

import scaletrain.metrics.meter as meter_module
from scaletrain.config import (
    Config,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    PrecisionConfig,
    SourceConfig,
    TrainingConfig,
)
from scaletrain.data.loader import DataLoader, Mixture, TokenShards
from scaletrain.data.prepare import prepare_data
from scaletrain.data.ramp import BatchRamp
from scaletrain.data.tokenizer import ByteTokenizer
from scaletrain.errors import ConfigError
from scaletrain.metrics.meter import StepMeter
from scaletrain.models.loss import cross_entropy
from scaletrain.models.presets import resolve_model_args
from scaletrain.optim.optimizers import Optimizers, build_optimizer
from scaletrain.parallel.layout import Layout, batch_problems
from scaletrain.parallel.step import StepRunner
from scaletrain.planning.estimators.hardware import GPUS
from scaletrain.planning.estimators.search import search
from scaletrain.validate import load_config
from tests.fixtures import tiny


def test_the_ramp_grows_linearly_in_multiples_of_start_then_stays_full():
    ramp = BatchRamp.of("2:3", 8)
    assert [ramp.sequences(s) for s in range(1, 7)] == [2, 4, 6, 8, 8, 8]
    assert [ramp.consumed(s) for s in range(7)] == [0, 2, 6, 12, 20, 28, 36]
    # A global batch that is no multiple of start: rungs of 3, capped at 10; never above it, never below start.
    odd = BatchRamp.of("3:4", 10)
    assert [odd.sequences(s) for s in range(1, 7)] == [3, 3, 6, 6, 10, 10]
    long = BatchRamp.of("4:1000", 256)
    sizes = [long.sequences(s) for s in range(1, 1002)]
    assert sizes == sorted(sizes) and sizes[0] == 4 and sizes[-1] == 256 and all(b % 4 == 0 for b in sizes)
    assert long.consumed(1001) == sum(sizes)
    off = BatchRamp.of("", 8)  # no ramp: every step the global batch, the schedule's position the step itself
    assert not off.on and off.sequences(1) == 8 and off.consumed(5) == 40 and off.schedule_position(3) == 3


def _optimizers(parts, cfg, ramp, total):
    return Optimizers(parts, lambda m: build_optimizer(m, cfg), cfg, total, ramp=ramp)


def test_the_lr_schedule_counts_tokens_and_resumes_where_the_step_says():
    cfg = OptimizerConfig(lr=1.0, warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    ramp, total = BatchRamp.of("2:4", 8), 10
    opts = _optimizers([torch.nn.Linear(2, 2)], cfg, ramp, total)
    lrs = []
    for _ in range(total):
        lrs.append(opts.lr)
        opts.step()
    consumed = [ramp.consumed(s) for s in range(total)]  # sequences before each update: 0 2 4 8 14 22 30 ...
    # Warmup in tokens: the lr is the unramped schedule's at the same token count (consumed / 8 full batches), so
    # the peak comes once 3 full batches (24 sequences) are in, as at an unramped run's 4th step: step 7 here.
    assert lrs[:7] == [min(1.0, (c / 8 + 1) / 4) for c in consumed[:7]]
    assert lrs[6] == 1.0 > lrs[5] and max(lrs) == 1.0  # never above the peak
    assert lrs[-1] == pytest.approx(0.1)  # the decay ends on the floor at the run's last step
    # A resume: the schedule's step count, loaded into a fresh one, gives the same learning rates from there.
    stopped = _optimizers([torch.nn.Linear(2, 2)], cfg, ramp, total)
    for _ in range(3):
        stopped.step()
    again = _optimizers([torch.nn.Linear(2, 2)], cfg, ramp, total)
    again.load_state_dict(stopped.state_dict())
    resumed = [again.lr]
    for _ in range(6):
        again.step()
        resumed.append(again.lr)
    assert resumed == lrs[3:10]


def _loaders(tmp_path: Path, dp: int) -> list[DataLoader]:
    path = tmp_path / "s.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps({"text": f"doc{i:04d}"}) + "\n" for i in range(60)))
    cfg = DataConfig(sources=[SourceConfig(path=str(path))], cache_dir=str(tmp_path / "cache"), workers=1)
    [(d, _)] = prepare_data(cfg, ByteTokenizer(), log=lambda s: None)
    mix = Mixture([(TokenShards(d), 1.0)], seq_len=4, val_fraction=0.0, seed=0)
    return [DataLoader(mix, global_batch=8, dp_rank=r, dp_size=dp) for r in range(dp)]


def test_ramped_steps_read_the_global_stream_in_order_once_on_any_number_of_ranks(tmp_path: Path):
    ramp = BatchRamp.of("2:3", 8)
    (single,) = _loaders(tmp_path, 1)
    stream = torch.stack([torch.from_numpy(single.mixture.sample(g)) for g in range(28)])
    steps = [single.next_batch(ramp.sequences(s))[0] for s in range(1, 6)]
    assert [len(x) for x in steps] == [2, 4, 6, 8, 8]
    assert torch.equal(torch.cat(steps), stream[:, :-1])  # every sample once, in order
    # Stopped after step 2 on one rank, continued on two: each rank takes its half of each later step.
    (first,) = _loaders(tmp_path, 1)
    for s in (1, 2):
        first.next_batch(ramp.sequences(s))
    ranks = _loaders(tmp_path, 2)
    for r in ranks:
        r.load_state_dict(first.state_dict())
    for s in (3, 4, 5):
        assert torch.equal(torch.cat([r.next_batch(ramp.sequences(s))[0] for r in ranks]), steps[s - 1])


def test_a_smaller_step_is_the_mean_over_its_own_tokens():
    """The ramp's first step has fewer micro-batches than a full one: its gradient must be the mean over its own
    sequences (each micro-batch loss divided by this step's count), not scaled as if the step were full."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (6, 9))
    for n in (2, 6):  # a ramped step of 2 sequences and a full step of 6, micro_batch 1
        x, y = tokens[:n, :-1], tokens[:n, 1:]
        model, whole = tiny(), tiny()
        loss = StepRunner([model], 1, contextlib.nullcontext(), 0.0).forward_backward(x, y)
        want = cross_entropy(whole(x), y)  # the mean over every token of the step, in one forward
        want.backward()
        assert loss.item() == pytest.approx(want.item(), rel=1e-6)
        for (name, p), q in zip(model.named_parameters(), whole.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_tokens_per_s_and_mfu_count_each_steps_own_tokens(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(meter_module.time, "perf_counter", lambda: now[0])
    m = StepMeter(1000, 2.0, 1e6, torch.device("cpu"))
    for tokens in (250, 500, 1000, 1000):  # a ramp's steps: 1/4, 1/2, then whole global batches
        now[0] += 1.0
        m.step_done(tokens)
    out = m.read()
    assert out["tokens_per_s"] == pytest.approx(2750 / 4)
    assert out["mfu"] == pytest.approx(2750 / 4 * 2.0 / 1e6)


def _problems(*overrides: str, world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(
            None, ["--training.global_batch", "8", *overrides], world_size=world_size, check_run_dir=False
        )
    return "\n".join(e.value.problems)


@pytest.mark.parametrize(
    "overrides, world, says",
    [
        (["--training.batch_ramp", "abc"], 1, "is not of the form 'start:steps'"),
        (["--training.batch_ramp", "4"], 1, "is not of the form 'start:steps'"),
        (["--training.batch_ramp", "0:10"], 1, "start and steps must both be >= 1"),
        (["--training.batch_ramp", "2:0"], 1, "start and steps must both be >= 1"),
        (["--training.batch_ramp", "16:10"], 1, "start 16 is above training.global_batch 8"),
        (["--training.batch_ramp", "2:10", "--training.micro_batch", "2"], 2, "use a start of 4"),
        (["--training.batch_ramp", "2:500"], 1, "ramp over at most"),
        (
            ["--training.batch_ramp", "4:10", "--training.micro_batch", "2", "--parallel.pp", "2"],
            2,
            "not supported with parallel.pp > 1: a pipeline schedule runs a fixed number of micro-batches",
        ),
    ],
)
def test_a_ramp_that_cannot_run_is_refused_with_the_reason(overrides, world, says):
    assert says in _problems(*overrides, world_size=world)


def test_a_ramp_each_rank_can_split_is_accepted():
    cfg = load_config(
        None,
        ["--training.global_batch", "8", "--training.micro_batch", "1", "--training.batch_ramp", "2:3"],
        world_size=2,
        check_run_dir=False,
    )
    assert cfg.training.batch_ramp == "2:3"


def test_the_planner_holds_its_candidates_to_the_ramp():
    """The planner's search with a ramp proposes only layouts that can run it: micro_batch x data-parallel ranks
    divide the ramp's first step, no pipeline. It asks what validate asks (batch_problems, through layout_problems),
    so the plans it drops are exactly those of the search without the ramp that cannot split the first step, each
    counted under the ramp's reason."""
    cfg = Config()
    cfg.training.global_batch, cfg.training.micro_batch, cfg.training.batch_ramp = 8, 1, "2:3"
    assert batch_problems(cfg.training, Layout.of(cfg, 2)) == []
    (problem,) = batch_problems(cfg.training, Layout.of(cfg, 4))
    assert "use a start of 4" in problem

    args = resolve_model_args(ModelConfig(preset="8B"), None, 8192)  # untied: pipeline layouts are candidates

    def plans(ramp: str) -> tuple[list, Counter]:
        t = TrainingConfig(global_batch=16, steps=100, eval_interval=0, batch_ramp=ramp)
        cfg = Config(model=ModelConfig(preset="8B"), data=DataConfig(seq_len=8192), training=t,
                     precision=PrecisionConfig(compute="bf16"))  # fmt: skip
        found, rejected, _ = search(cfg, args, 8, GPUS["h100"], 8)
        return found, rejected

    def runs_the_ramp(plan) -> bool:  # a start of 2 sequences
        return 2 % (plan.cfg.training.micro_batch * plan.layout.dp_size) == 0 and plan.cfg.parallel.pp == 1

    def key(plan) -> tuple:
        return tuple(sorted(plan.choices().items()))

    free, _ = plans("")
    ramped, rejected = plans("2:10")
    cannot = [p.describe() for p in ramped if not runs_the_ramp(p)]
    assert ramped and not cannot, cannot
    assert {key(p) for p in ramped} == {key(p) for p in free if runs_the_ramp(p)}
    assert len(ramped) < len(free)  # the ramp removed some: dp 4 and 8, micro_batch 2 on 2 ranks, pipelines
    assert rejected["the batch ramp's first step does not split"] > 0
    assert rejected["the batch ramp cannot run with pipeline stages"] > 0
