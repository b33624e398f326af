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
    """A snapshot of step 5 taken when the loader's next sample was 100: restoring it restores that position too, as
    the checkpoint manager restores every Stateful; the guard then decides whether to skip the batches since."""

    last_source = "memory"

    def __init__(self, loader: _Loader) -> None:
        self.loader = loader

    def load_latest(self) -> int:
        self.loader.load_state_dict({"next_sample": 100})
        return 5


class _Loader:
    def __init__(self) -> None:
        self.next_sample = 100

    def state_dict(self) -> dict:
        return {"next_sample": self.next_sample}

    def load_state_dict(self, sd: dict) -> None:
        self.next_sample = sd["next_sample"]


def _guard(rank: int, world_size: int, model: nn.Module) -> tuple[Guard, list]:
    """A guard with sdc and spike detection over a gloo control group (never the default group), and its events."""
    control = dist.new_group(backend="gloo")
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size,
                  device=torch.device("cpu"))  # fmt: skip
    events: list = []
    cfg = ResilienceConfig(sdc_interval=100, spike_zscore=3.0, spike_window=20, nan_check=False)
    guard = Guard(cfg, None, env, control, lambda kind, **kw: events.append((kind, kw)), lambda x: x,
                  parts=[model])  # fmt: skip
    return guard, events


def _ranks(rank: int, world_size: int) -> None:
    torch.manual_seed(0)  # the same weights on every rank: replicas
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    guard, events = _guard(rank, world_size, model)
    one = torch.tensor(1.0)
    steady = [3.0 + 0.01 * (s % 2) for s in range(12)]
    for step, loss in enumerate(steady, 1):
        assert guard.check(step, torch.tensor(loss), one) == "ok"
    # A spike on identical replicas: the data's. Rolled back, the batches since the snapshot skipped.
    assert guard.check(13, torch.tensor(9.0), one) == "rollback"
    assert [k for k, _ in events] == ["loss_spike", "spike_cause"]
    assert events[1][1] == dict(step=13, spike="loss_spike", cause="data", replayed=False)  # no Transformer
    loader = _Loader()
    loader.next_sample = 140
    assert guard.rollback(13, _Ckpt(loader), loader) == 5
    assert events[-1][1]["skipped_batches"] == 8 and "reason" not in events[-1][1]
    assert loader.next_sample == 140  # the snapshot's weights, the data from where the spike left it: skipped

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
    assert guard.rollback(17, _Ckpt(loader), loader) == 5
    assert events[-1][1]["reason"] == "sdc" and events[-1][1]["skipped_batches"] == 0
    assert loader.next_sample == 100  # the snapshot's position: the batches since are trained again


def test_a_spike_is_blamed_on_the_device_only_when_the_replicas_differ():
    spawn(_ranks, 3)


def _replay_ranks(rank: int, world_size: int) -> None:
    """Three replicas of a small Transformer, each with its own batch. A spike asks for a replay of the step's
    forward on each rank and its buddy: clean, the spike is the data's; a transient fault in rank 1's forward (one
    flipped bit in an activation) names rank 1 ("replay"); a device that computes wrong every time names rank 1
    ("buddy": rank 2 computes rank 1's batch otherwise, and rank 0 agrees with its own buddy)."""
    from scaletrain.models import ModelArgs, build_model

    args = ModelArgs(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64, max_seq_len=16
    )
    model = build_model(args, seed=0, device="cpu")  # the same weights on every rank: replicas
    guard, events = _guard(rank, world_size, model)
    batch = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
    fault = {"on": False, "once": True}

    def flip(module, inputs, output):  # an ALU fault: one bit of one activation
        if fault["on"]:
            fault["on"] = not fault["once"]
            output.view(-1)[5:6].view(torch.int32).bitwise_xor_(1 << 12)

    if rank == 1:
        model.layers["0"].feed_forward.register_forward_hook(flip)

    def step(n: int, loss: float, grad_norm: float) -> str:
        model(batch).sum().backward()  # a training forward (and backward), as the step runner's
        return guard.check(n, torch.tensor(loss), torch.tensor(grad_norm))

    steady = [3.0 + 0.01 * (s % 2) for s in range(12)]
    for n, loss in enumerate(steady, 1):
        assert step(n, loss, loss) == "ok"

    def kinds() -> list[str]:
        return [k for k, _ in events]

    def cause() -> dict:
        return next(kw for k, kw in events if k == "spike_cause")

    # A loss spike, every forward reproducible on its buddy: the data's (rolled back, batches skipped).
    assert step(13, 9.0, 3.0) == "rollback"
    assert kinds() == ["loss_spike", "spike_cause"] and cause()["cause"] == "data" and cause()["replayed"], (
        events
    )
    events.clear()
    # A grad-norm spike, clean: the data's; the update goes on.
    assert step(14, 3.0, 9.0) == "ok"
    assert kinds() == ["grad_norm_spike", "spike_cause"] and cause()["cause"] == "data", events
    events.clear()
    fault["on"] = True  # transient: rank 1's forward of step 15 only
    assert step(15, 9.0, 3.0) == "rollback"
    assert kinds() == ["loss_spike", "spike_cause", "sdc_detected"] and cause()["cause"] == "device", events
    found = events[-1][1]
    assert found["ranks"] == [1] and found["how"] == {"1": "replay"} and found["where"] == "loss_spike", found
    assert found["params"] == {"1": ["logits"]} and found["attributed"], found
    loader = _Loader()
    loader.next_sample = 150  # where step 15 left it
    assert guard.rollback(15, _Ckpt(loader), loader) == 5 and events[-1][1]["reason"] == "sdc"
    assert loader.next_sample == 100
    events.clear()
    fault.update(on=True, once=False)  # a device wrong every time: its own replay agrees with it
    assert step(16, 3.0, 9.0) == "rollback"
    assert kinds() == ["grad_norm_spike", "spike_cause", "sdc_detected"], events
    found = events[-1][1]
    assert (found["ranks"], found["how"], found["where"]) == ([1], {"1": "buddy"}, "grad_norm_spike"), found


def test_a_spike_replays_the_forward_on_a_buddy_and_names_the_rank_that_computed_wrong():
    spawn(_replay_ranks, 3)
