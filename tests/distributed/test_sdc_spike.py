"""A loss spike with resilience.sdc_interval on (issue 25 part 2): the guard compares the replicas' fingerprints over
the control group before blaming the data. Three gloo ranks holding one replicated model: a spike with identical
replicas is the data's (rolled back with its batches skipped); a spike after one rank's weights took a flipped bit is
that rank's device (sdc_detected names it by majority; rolled back without skipping data)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.config import ResilienceConfig
from scaletrain.parallel.mesh import DistEnv
from scaletrain.resilience.guard import Guard
from tests.distributed.spawn import spawn


class _Ckpt:
    last_source = "memory"

    def load_latest(self) -> int:
        return 5


class _Loader:
    def __init__(self) -> None:
        self.next_sample = 100

    def state_dict(self) -> dict:
        return {"next_sample": self.next_sample}

    def load_state_dict(self, sd: dict) -> None:
        self.next_sample = sd["next_sample"]


def _ranks(rank: int, world_size: int) -> None:
    torch.manual_seed(0)  # the same weights on every rank: replicas
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    control = dist.new_group(backend="gloo")  # the control plane, never the default group
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size,
                  device=torch.device("cpu"))  # fmt: skip
    events: list = []
    cfg = ResilienceConfig(sdc_interval=100, spike_zscore=3.0, spike_window=20, nan_check=False)
    guard = Guard(cfg, None, env, control, lambda kind, **kw: events.append((kind, kw)), lambda x: x,
                  parts=[model])  # fmt: skip
    one = torch.tensor(1.0)
    steady = [3.0 + 0.01 * (s % 2) for s in range(12)]
    for step, loss in enumerate(steady, 1):
        assert guard.check(step, torch.tensor(loss), one) == "ok"
    # A spike on identical replicas: the data's. Rolled back, the batches since the snapshot skipped.
    assert guard.check(13, torch.tensor(9.0), one) == "rollback"
    assert [k for k, _ in events] == ["loss_spike"]
    loader = _Loader()
    loader.next_sample = 140
    assert guard.rollback(13, _Ckpt(), loader) == 5
    assert events[-1][1]["skipped_batches"] == 8 and "reason" not in events[-1][1]

    events.clear()
    if rank == 1:  # a faulty device: one low mantissa bit of one weight
        with torch.no_grad():
            model[0].weight.view(-1).view(torch.int32)[3:4].bitwise_xor_(1 << 10)
    for step, loss in enumerate(steady[:3], 14):
        assert guard.check(step, torch.tensor(loss), one) == "ok"
    assert guard.check(17, torch.tensor(9.0), one) == "rollback"
    (spike, _), (kind, found) = events[:2]
    assert (spike, kind) == ("loss_spike", "sdc_detected"), events
    assert found["rank"] == 1 and found["params"] == {"1": ["0.weight"]} and found["how"] == {"1": "replica"}
    assert found["where"] == "loss_spike"
    loader.next_sample = 160
    assert guard.rollback(17, _Ckpt(), loader) == 5
    assert events[-1][1]["reason"] == "sdc" and events[-1][1]["skipped_batches"] == 0
    assert (
        loader.next_sample == 160
    )  # untouched: the checkpoint manager's restore sets the snapshot's position


def test_a_spike_is_blamed_on_the_device_only_when_the_replicas_differ():
    spawn(_ranks, 3)
