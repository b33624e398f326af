"""Silent data corruption in the optimizer state, on replicas (issue 39): the sdc check fingerprints parameters only,
but where every replica computes its own update (ddp, hsdp) a flipped bit in one rank's Adam moment makes that rank's
next update differ, and the replicas' parameters then tell at the next check. Three gloo ranks, each a replica of one
model under its own AdamW, its gradients averaged as DDP does; the flip is attached from outside the guard, in a
forward pre-hook. (One process, where nothing can tell: tests/unit/test_sdc.py.)"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.config import ResilienceConfig
from scaletrain.parallel.mesh import DistEnv
from scaletrain.resilience.guard import Guard
from tests.distributed.spawn import spawn


def _ranks(rank: int, world_size: int) -> None:
    torch.manual_seed(0)  # the same weights on every rank: replicas
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size,
                  device=torch.device("cpu"))  # fmt: skip
    events: list = []
    guard = Guard(ResilienceConfig(sdc_interval=3, nan_check=False), None, env, dist.new_group(backend="gloo"),
                  lambda kind, **kw: events.append((kind, kw)), lambda x: x, parts=[model])  # fmt: skip
    at = {"step": 0}

    def flip(module: nn.Module, args: tuple) -> None:
        """Rank 1's device: one low mantissa bit of one Adam moment, in step 5's forward."""
        if rank == 1 and at["step"] == 5:
            moment = opt.state[model[0].weight]["exp_avg"]
            moment.view(-1).view(torch.int32)[3:4].bitwise_xor_(1 << 10)

    model.register_forward_pre_hook(flip)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))  # its own batch
    decisions = []
    for step in range(1, 7):
        at["step"] = step
        loss = model(x).square().mean()
        loss.backward()
        # DDP: the gradients averaged, so only the optimizer state can set a replica apart
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
        assert guard.check(step, loss.detach(), loss.detach()) == "ok"
        opt.step()
        opt.zero_grad()
        decisions.append(guard.after_update(step, "ok"))
    assert decisions == ["ok"] * 5 + ["rollback"], decisions
    (found,) = [kw for kind, kw in events if kind == "sdc_detected"]
    # Rank 1's update of step 5 used the flipped moment: its weight is the minority at the check of step 6.
    assert (found["step"], found["ranks"], found["how"]) == (6, [1], {"1": "replica"}), found
    assert found["params"] == {"1": ["0.weight"]} and found["attributed"], found


def test_a_flip_in_one_replicas_optimizer_state_is_found_through_its_update():
    spawn(_ranks, 3)
