import torch

from scaletrain.config import OptimizerConfig
from scaletrain.optim import build_optimizer, lr_factor
from tests.unit.test_model import tiny


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
    opt = build_optimizer(model, OptimizerConfig(weight_decay=0.1), torch.device("cpu"))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    norm_ids = {id(p) for n, p in model.named_parameters() if "norm" in n}
    assert norm_ids == {id(p) for p in no_decay["params"]}
