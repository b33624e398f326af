import math

import pytest
import torch

from scaletrain.config import OptimizerConfig
from scaletrain.optim.optimizers import Optimizers, build_optimizer, lr_factor
from tests.fixtures import tiny


def test_warmup_then_cosine_reaches_the_floor():
    cfg = OptimizerConfig(warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    f = [lr_factor(s, cfg, 100) for s in range(100)]
    assert f[0] == 0.1 and f[9] == 1.0
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert abs(f[-1] - 0.1) < 1e-9


def test_linear_and_wsd_shapes():
    lin = OptimizerConfig(warmup_steps=0, schedule="linear", min_lr_ratio=0.0)
    assert lr_factor(49, lin, 100) == 0.5 and lr_factor(99, lin, 100) == 0.0
    wsd = OptimizerConfig(warmup_steps=5, schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.0)
    assert [lr_factor(s, wsd, 100) for s in (5, 50, 79)] == [1.0, 1.0, 1.0]
    assert lr_factor(80, wsd, 100) < 1.0 and lr_factor(99, wsd, 100) == 0.0


def test_norms_get_no_weight_decay():
    model = tiny()
    opt = build_optimizer(model, OptimizerConfig(weight_decay=0.1))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    norm_ids = {id(p) for n, p in model.named_parameters() if "norm" in n}
    assert norm_ids == {id(p) for p in no_decay["params"]}


@pytest.mark.parametrize(
    "implementation, fused, foreach",
    [("auto", True, False), ("foreach", False, True), ("for-loop", False, False), ("fused", True, False)],
)
def test_auto_adamw_is_torchs_fused_kernel_on_a_cpu_too(implementation, fused, foreach):
    opt = build_optimizer(tiny(), OptimizerConfig(implementation=implementation))
    assert (opt.defaults["fused"], opt.defaults["foreach"]) == (fused, foreach)


def test_the_fused_adamw_steps_as_the_foreach_one_does():
    """The default on a CPU (fused, one pass per tensor) trains what foreach trained, to fp32 rounding: the same
    weights and moments after 5 steps of a tiny model, weight decay and a norm group included. A wrong kernel (no
    bias correction, decay on the norms) moves them by far more."""
    got = {}
    for impl in ("fused", "foreach"):
        model = tiny()
        opt = build_optimizer(model, OptimizerConfig(implementation=impl, weight_decay=0.1, lr=1e-2))
        torch.manual_seed(1)
        for _ in range(5):
            model(torch.randint(0, 64, (2, 16))).float().logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        got[impl] = [p.detach().clone() for p in model.parameters()] + [
            s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")
        ]
    assert len(got["fused"]) == len(got["foreach"])
    for a, b in zip(got["fused"], got["foreach"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(got["fused"][0], tiny().tok_embeddings.weight)  # it trained


def _optimizers(parts, total_steps=10):
    cfg = OptimizerConfig(warmup_steps=2)
    return Optimizers(parts, lambda m: build_optimizer(m, cfg), cfg, total_steps)


def _backward(parts, scale=1.0):
    (parts[1](parts[0](torch.randn(3, 4))).sum() * scale).backward()


def test_a_skipped_step_drops_the_gradients_keeps_weights_and_moments_and_advances_the_schedule():
    """What a skipped step (non-finite gradients) advances is decided in one place: the LR schedule follows the
    step count, the weights and AdamW moments stay as they were, the gradients are freed."""
    torch.manual_seed(0)
    parts = [torch.nn.Linear(4, 2), torch.nn.Linear(2, 1)]
    opts = _optimizers(parts)
    _backward(parts)
    opts.step()
    weights = [p.detach().clone() for part in parts for p in part.parameters()]
    moments = [s["exp_avg"].clone() for o in opts.optimizers for s in o.state.values()]
    lr_before = opts.lr
    _backward(parts, math.nan)
    opts.step(skip=True)
    assert all(p.grad is None for part in parts for p in part.parameters())  # set_to_none, not zeros
    assert all(torch.equal(a, p) for a, p in zip(weights, (p for part in parts for p in part.parameters())))
    assert all(
        torch.equal(a, s["exp_avg"])
        for a, s in zip(moments, (s for o in opts.optimizers for s in o.state.values()))
    )
    assert [s.last_epoch for s in opts.schedulers] == [2, 2] and opts.lr != lr_before


def test_optimizers_state_round_trips_the_schedule_step_and_the_moments():
    torch.manual_seed(0)
    parts = [torch.nn.Linear(4, 2), torch.nn.Linear(2, 1)]
    opts = _optimizers(parts)
    for _ in range(3):
        _backward(parts)
        opts.step()
    sd = opts.state_dict()
    fresh = _optimizers(parts)
    fresh.load_state_dict(sd)
    assert fresh.schedulers[0].last_epoch == 3 and fresh.lr == opts.lr
    assert torch.equal(fresh.optimizers[1].state[parts[1].weight]["exp_avg_sq"],
                       opts.optimizers[1].state[parts[1].weight]["exp_avg_sq"])  # fmt: skip
