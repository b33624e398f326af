"""Context parallel on gloo: ring attention equals full causal SDPA on the gathered sequence (outputs and input
gradients), and 10 training steps with every sequence split over cp ranks match the single-process reference."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from scaletrain.models.attention import causal_sdpa
from scaletrain.optim import build_lr_scheduler, build_optimizer
from scaletrain.parallel.context_parallel import RingAttention, apply_cp, cp_shard_batch, cp_split
from tests.distributed.reference import (
    OPT,
    assert_close_run,
    full_model,
    global_batches,
    reference_run,
    tiny_args,
)
from tests.distributed.spawn import spawn

MICRO_BATCH = 4


def _check_ring_attention(group, rank: int, size: int) -> None:
    """Same random q/k/v on every rank; each rank feeds its shard to ring attention and compares with its shard
    of full causal SDPA, in float64 (tight) and bf16 (fp32 inside, so close to the fp32 reference)."""
    g = torch.Generator().manual_seed(7)
    b, hq, hkv, s, d = 2, 4, 2, 8 * size, 8
    q, k, v = (
        torch.randn(b, h, s, d, generator=g, dtype=torch.float64, requires_grad=True) for h in (hq, hkv, hkv)
    )
    dout = torch.randn(b, hq, s, d, generator=g, dtype=torch.float64)
    ref = causal_sdpa(q, k, v)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for lb in (True, False):
        ring = RingAttention(group, load_balance=lb)

        def shard(t: torch.Tensor, dt: torch.dtype = torch.float64, lb: bool = lb) -> torch.Tensor:
            return cp_split(t.detach(), rank, size, lb, dim=2).to(dt)

        for dt, tol in ((torch.float64, 1e-12), (torch.bfloat16, 2e-2)):
            ql, kl, vl = (shard(t, dt).requires_grad_() for t in (q, k, v))
            out = ring(ql, kl, vl)
            assert out.dtype == dt
            got = (out, *torch.autograd.grad(out, (ql, kl, vl), shard(dout, dt)))
            for name, a, want in zip(("out", "dq", "dk", "dv"), got, (ref, *ref_grads)):
                torch.testing.assert_close(
                    a.double(),
                    shard(want),
                    rtol=tol,
                    atol=tol,
                    msg=lambda m, n=name, lb=lb, dt=dt: f"{n} lb={lb} {dt}: {m}",
                )


def _train_cp(dp: int, cp: int, lb: bool, dp_rank: int, cp_mesh, world: dist.ProcessGroup | None) -> None:
    args = tiny_args()
    model = full_model(args)
    batches = global_batches(args)
    ref = reference_run(model, batches, micro_batch=MICRO_BATCH)
    apply_cp(model, cp_mesh, load_balance=lb)
    opt = build_optimizer(model, OPT, torch.device("cpu"))
    sched = build_lr_scheduler(opt, OPT, len(batches))
    n_ranks = dp * cp
    losses, norms = [], []
    for x, y in batches:
        x, y = x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]
        x, y, pos = cp_shard_batch(x, y, cp_mesh, lb)
        xs, ys = x.split(MICRO_BATCH), y.split(MICRO_BATCH)
        loss_sum = torch.zeros(())
        for xm, ym in zip(xs, ys):
            loss = F.cross_entropy(model(xm, positions=pos).flatten(0, 1), ym.flatten())
            (loss / len(xs)).backward()
            loss_sum += loss.detach()
        # Every rank's loss is a mean over equally many tokens, so the global loss and gradient are the means
        # over all dp×cp ranks (what DDP/FSDP over the flattened mesh would do).
        for p in model.parameters():
            dist.all_reduce(p.grad, group=world)
            p.grad /= n_ranks
        dist.all_reduce(loss_sum, group=world)
        losses.append((loss_sum / len(xs) / n_ranks).item())
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    state = {k: v.detach() for k, v in model.state_dict().items()}
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses + norms, ref["losses"] + ref["grad_norms"]))
    params = max((state[k] - v).abs().max().item() for k, v in ref["state"].items())
    if dist.get_rank() == 0:  # the tolerance reached, for the record (pytest -s)
        print(
            f"dp{dp} cp{cp} {'zigzag' if lb else 'contiguous'}: max rel diff loss/grad-norm {worst:.1e}, "
            f"max abs param diff {params:.1e}"
        )
    assert_close_run(losses, norms, state, ref, rtol=1e-5)


def _cp2(rank: int, world_size: int) -> None:
    _check_ring_attention(None, rank, world_size)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    for lb in (True, False):
        _train_cp(1, world_size, lb, 0, mesh, None)


def _cp4_and_dp2_cp2(rank: int, world_size: int) -> None:
    _check_ring_attention(None, rank, world_size)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    _train_cp(2, 2, True, mesh["dp"].get_local_rank(), mesh["cp"], None)


def test_cp2_ring_attention_and_training_match_reference():
    spawn(_cp2, 2)


def test_cp4_ring_attention_and_dp2_cp2_training_match_reference():
    spawn(_cp4_and_dp2_cp2, 4)
