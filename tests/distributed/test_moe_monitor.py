"""MoEMonitor and RoutingBias over 2 gloo processes, first as data-parallel replicas, then as pipeline stages: the
loads are summed over the data-parallel ranks (so the bias update is the same on every replica), and every stage's
layers reach every rank's metrics."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from scaletrain.config import MoEConfig
from scaletrain.metrics.moe import MoEMonitor
from scaletrain.optim.optimizers import RoutingBias
from tests.distributed.spawn import spawn
from tests.fixtures import fill_load, moe_layer, moe_model

CFG = MoEConfig(bias_update_rate=0.1, imbalance_threshold=1.4, imbalance_steps=1)


def _monitor(model, layers: tuple[int, ...], seen: list, **meshes) -> MoEMonitor:
    event = lambda kind, **f: seen.append({"kind": kind, **f})  # noqa: E731
    return MoEMonitor({i: moe_layer(model, i) for i in layers}, 4, 4, CFG, event=event, **meshes)


def _ranks(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))["x"]
    # Data parallel: both ranks hold blocks 1 and 3 and route different tokens.
    model, seen = moe_model(moe_ids=(1, 3)), []
    mon = _monitor(model, (1, 3), seen, dp_cp=mesh)
    layer1, layer3 = moe_layer(model, 1), moe_layer(model, 3)
    fill_load(layer1, [[6, 2, 0, 0], [0, 2, 4, 2]][rank], aux=1.0 + rank, forwards=1)  # sum [6, 4, 4, 2]
    fill_load(layer3, [[1, 1, 1, 1], [3, 1, 1, 3]][rank], aux=1.0, forwards=1)  # sum [4, 2, 2, 4]
    RoutingBias([layer1, layer3], 4, CFG.bias_update_rate, mesh).step()
    mon.step_done(1)
    torch.testing.assert_close(layer1.router.expert_bias, torch.tensor([-0.1, 0.0, 0.0, 0.1]))
    torch.testing.assert_close(layer3.router.expert_bias, torch.tensor([-0.1, 0.1, 0.1, -0.1]))
    m = mon.metrics()
    assert m["moe_load_max_mean/layer1"] == 6 / 4 and m["moe_load_max_mean/layer3"] == 4 / 3, m
    assert abs(m["moe_aux_loss"] - (1.5 + 1.0) / 2) < 1e-6, m  # per forward over both ranks, mean of layers
    assert [(e["kind"], e["layer"]) for e in seen] == [("moe_imbalance", 1)]  # 1.5 > 1.4, 1.33 is not

    # Pipeline: rank 0 holds block 1, rank 1 block 3; each reports both.
    layer = (1, 3)[rank]
    model, seen = moe_model(moe_ids=(layer,)), []
    mon = _monitor(model, (layer,), seen, pp=mesh)
    fill_load(moe_layer(model, layer), [[6, 2, 0, 0], [4, 2, 2, 4]][rank], aux=2.0 * (rank + 1), forwards=2)
    mon.step_done(1)
    m = mon.metrics()
    assert m["moe_load_max_mean/layer1"] == 6 / 2 and m["moe_load_max_mean/layer3"] == 4 / 3, m
    assert m["moe_load_max_mean"] == 3.0 and abs(m["moe_aux_loss"] - (1.0 + 2.0) / 2) < 1e-6, m
    assert [(e["kind"], e["layer"]) for e in seen] == [("moe_imbalance", 1)]  # on every rank alike


def test_loads_are_summed_over_dp_and_gathered_over_pp():
    spawn(_ranks, 2)
