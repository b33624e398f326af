"""MoEMonitor on one process, and the routing-bias update (DeepSeek-V3) that Optimizers steps: the bias update, the
moe_* metrics from constructed load buffers (read only: the monitor moves no bias), the
moe_imbalance event's episodes, its state across a resume, and the metrics of a short debug_moe run; and the step's
aux-loss scale (1/n micro-batches)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from scaletrain.config import MoEConfig, OptimizerConfig
from scaletrain.metrics.moe import MoEMonitor, moe_layers
from scaletrain.models.llama import ModelArgs
from scaletrain.optim.optimizers import Optimizers, RoutingBias, build_optimizer
from tests.fixtures import MOE_EXPERTS as E
from tests.fixtures import fill_load, moe_layer, moe_model
from tests.helpers import QUICK, ROOT, events, read_jsonl


def _monitor(model: nn.Module, n_experts: int = E, **cfg) -> tuple[MoEMonitor, list[dict]]:
    seen: list[dict] = []
    mon = MoEMonitor(
        moe_layers([model]),
        len(model.layers),
        n_experts,
        MoEConfig(**cfg),
        event=lambda kind, **f: seen.append({"kind": kind, **f}),
    )
    return mon, seen


def test_moe_layers_are_found_by_layer_id_through_wrappers():
    model = moe_model()
    wrapped = nn.Module()
    wrapped._orig_mod = (
        model  # torch.compile's and checkpoint_wrapper's prefixes leave the layer id in the name
    )
    assert sorted(moe_layers([wrapped])) == [1, 3]
    assert moe_layers([wrapped])[3] is moe_layer(model, 3)


def test_metrics_from_constructed_buffers_and_buffers_reset():
    model = moe_model()
    mon, _ = _monitor(model)
    fill_load(moe_layer(model, 1), [4, 4, 4, 4], dropped=2, aux=2.0, z=0.4, forwards=2)
    fill_load(moe_layer(model, 3), [8, 0, 4, 4], dropped=0, aux=3.3, z=0.9, forwards=3)
    mon.step_done(1)
    m = mon.metrics()
    assert set(m) == {
        "moe_load_max_mean/layer1",
        "moe_load_max_mean/layer3",
        "moe_load_max_mean",
        "moe_dropped",
        "moe_aux_loss",
        "moe_z_loss",
    }
    assert m["moe_load_max_mean/layer1"] == pytest.approx(1.0)
    assert m["moe_load_max_mean/layer3"] == pytest.approx(2.0)  # max 8 over mean 4
    assert m["moe_load_max_mean"] == pytest.approx(2.0)  # the worst layer
    assert m["moe_dropped"] == pytest.approx(2 / 32)  # over both layers' routed assignments
    assert m["moe_aux_loss"] == pytest.approx((2.0 / 2 + 3.3 / 3) / 2)  # per forward, averaged over layers
    assert m["moe_z_loss"] == pytest.approx((0.4 / 2 + 0.9 / 3) / 2)
    for i in (1, 3):
        assert float(moe_layer(model, i).tokens_per_expert.sum()) == 0.0
        assert float(moe_layer(model, i).forwards) == 0.0


def _optimizers(model: nn.Module, rate: float) -> Optimizers:
    cfg = OptimizerConfig()
    bias = RoutingBias.for_model([model], E, rate, None)
    return Optimizers([model], lambda m: build_optimizer(m, cfg), cfg, 10, bias)


def test_bias_moves_each_expert_towards_the_mean_by_the_rate():
    model = moe_model()
    mon, _ = _monitor(model)
    start = torch.tensor([0.1, -0.2, 0.0, 0.3])
    for i in (1, 3):
        moe_layer(model, i).router.expert_bias.copy_(start)
    fill_load(moe_layer(model, 1), [10, 2, 5, 3])  # mean 5: over, under, even, under
    fill_load(moe_layer(model, 3), [1, 1, 1, 9])  # mean 3
    _optimizers(model, 0.01).step()  # as the loop: the optimizers' step, then the monitor reads and clears
    mon.step_done(1)
    torch.testing.assert_close(
        moe_layer(model, 1).router.expert_bias, start + 0.01 * torch.tensor([-1.0, 1.0, 0.0, 1.0])
    )
    torch.testing.assert_close(
        moe_layer(model, 3).router.expert_bias, start + 0.01 * torch.tensor([1.0, 1.0, 1.0, -1.0])
    )


def test_no_bias_update_when_off_on_a_skipped_step_or_by_the_monitor():
    model = moe_model()
    assert RoutingBias.for_model([model], E, 0.0, None) is None  # off
    assert RoutingBias.for_model([moe_model(moe_ids=())], E, 0.01, None) is None  # no MoE layer to move
    mon, _ = _monitor(model, bias_update_rate=0.01)
    fill_load(moe_layer(model, 1), [10, 2, 5, 3])
    mon.step_done(1)  # metrics read the load, they never move a bias
    assert torch.count_nonzero(moe_layer(model, 1).router.expert_bias) == 0
    on = _optimizers(model, 0.01)
    fill_load(moe_layer(model, 1), [10, 2, 5, 3])
    on.step(skip=True)  # a skipped step: its batch moves nothing ...
    assert torch.count_nonzero(moe_layer(model, 1).router.expert_bias) == 0
    mon.step_done(2, applied=False)  # ... and its counts are cleared
    assert float(moe_layer(model, 1).tokens_per_expert.sum()) == 0.0


def _route(model: nn.Module, skewed: bool, seed: int) -> None:
    """One forward of layer 1 with gradients on: all tokens to experts 0 and 1 (skewed), else a random router."""
    m = moe_layer(model, 1)
    with torch.no_grad():
        m.router.expert_bias.copy_(torch.tensor([5.0, 5.0] + [0.0] * (E - 2)) if skewed else torch.zeros(E))
    x = torch.randn(4, 64, 8, generator=torch.Generator().manual_seed(seed))
    m(x)


def test_imbalance_event_fires_after_exactly_n_steps_once_per_episode():
    model = moe_model(moe_ids=(1,))
    mon, seen = _monitor(model, imbalance_threshold=1.5, imbalance_steps=3)
    pattern = [True] * 6 + [False] + [True] * 3  # an episode of 6 steps, a recovery, then a new episode
    for step, skewed in enumerate(pattern, start=1):
        _route(model, skewed, step)
        mon.step_done(step)
        ratio = mon.metrics()["moe_load_max_mean/layer1"]
        assert (
            ratio == pytest.approx(2.0) if skewed else ratio < 1.5
        )  # all tokens on 2 of 4 experts: 2x the mean
    assert [(e["kind"], e["step"], e["layer"]) for e in seen] == [
        ("moe_imbalance", 3, 1),
        ("moe_imbalance", 10, 1),
    ]
    assert seen[0]["load_max_mean"] == pytest.approx(2.0) and seen[0]["threshold"] == 1.5


def test_state_round_trip_continues_the_streak():
    model = moe_model(moe_ids=(1,))
    mon, _ = _monitor(model, imbalance_threshold=1.5, imbalance_steps=3)
    for step in (1, 2):
        _route(model, True, step)
        mon.step_done(step)
    saved = {k: v.clone() for k, v in mon.state_dict().items()}
    assert saved["streak"].tolist() == [0, 2, 0, 0]
    resumed, seen = _monitor(model, imbalance_threshold=1.5, imbalance_steps=3)
    resumed.load_state_dict(saved)
    saved["streak"].zero_()  # the monitor holds its own copy
    _route(model, True, 3)
    resumed.step_done(3)
    assert [e["step"] for e in seen] == [3]  # the third consecutive step, counted across the resume
    assert resumed.state_dict()["alerted"].tolist() == [0, 1, 0, 0]


def test_a_dense_model_has_no_moe_state_or_metrics():
    model = moe_model(moe_ids=())
    mon, _ = _monitor(model, n_experts=0)
    mon.step_done(1)
    assert not mon.active and mon.metrics() == {} and mon.resumable() == {}


def test_debug_moe_run_writes_moe_metrics(tmp_path: Path):
    from scaletrain.models.moe import is_moe_layer
    from scaletrain.models.presets import resolve_model_args
    from scaletrain.train import train
    from scaletrain.validate import load_config

    overrides = ["--training.steps", "4", "--training.eval_interval", "0", "--metrics.log_interval", "2"]
    overrides += ["--moe.bias_update_rate", "0.001", "--moe.imbalance_threshold", "1.0"]
    overrides += ["--moe.imbalance_steps", "2", "--run.dir", str(tmp_path / "run"), *QUICK]
    cfg = load_config(ROOT / "configs" / "debug_moe.toml", overrides)
    train(cfg)
    args = resolve_model_args(cfg.model, 257, cfg.data.seq_len, moe=cfg.moe)
    ids = [i for i in range(args.n_layers) if is_moe_layer(args, i)]
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        per_layer = [r[f"moe_load_max_mean/layer{i}"] for i in ids]
        assert all(v >= 1.0 for v in per_layer) and r["moe_load_max_mean"] == pytest.approx(max(per_layer))
        assert r["moe_dropped"] == 0.0  # dropless by default
        assert r["moe_aux_loss"] > 0
    # A threshold of 1.0 is exceeded by any imbalance at all: each MoE layer's episode fires once, at step 2.
    fired = events(tmp_path / "run", "moe_imbalance")
    assert sorted(e["layer"] for e in fired) == ids and {e["step"] for e in fired} == {2}


@pytest.mark.parametrize("scaled", [True, False])
def test_aux_losses_weigh_the_same_whatever_the_micro_batch_count(scaled, monkeypatch):
    """StepRunner sets the aux losses' backward scale to 1/n micro-batches, as the LM loss is divided: the router's
    gradient from one batch of 4 equals that from 4 micro-batches of 1 (and differs without the scale)."""
    import contextlib

    from scaletrain.models.presets import build_model
    from scaletrain.parallel.step import StepRunner

    if not scaled:  # what the step would do without it: the aux losses weighed n times
        monkeypatch.setattr(StepRunner, "_scale_aux_losses", lambda self, n: None)
    args = ModelArgs(dim=16, n_layers=2, n_heads=2, n_kv_heads=2, ffn_hidden=32, vocab_size=64, max_seq_len=8)
    args = dataclasses.replace(args, n_experts=4, top_k=2, moe_hidden=16, aux_loss_coef=0.5, z_loss_coef=0.1)
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0))
    grads = []
    for micro in (4, 1):
        model = build_model(args, 0, "cpu")
        runner = StepRunner([model], micro, contextlib.nullcontext(), 0.0)
        runner.forward_backward(tokens[:, :-1], tokens[:, 1:])
        grads.append(model.layers["1"].feed_forward.router.gate.weight.grad.clone())
    if scaled:
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)
    else:
        assert not torch.allclose(grads[1], grads[0], rtol=1e-3)
