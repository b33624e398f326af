"""Context parallel on gloo: ring attention equals full causal SDPA on the gathered sequence (outputs and input
gradients), and 10 training steps with every sequence split over cp ranks (through `train_steps`) match the
single-process reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from scaletrain.models.attention import causal_sdpa
from scaletrain.parallel import context_parallel as cp
from scaletrain.parallel.context_parallel import RingAttention, cp_split
from scaletrain.parallel.recompute import checkpoint_forward
from tests.distributed.reference import check_equivalent, layout_case, run_layouts, tiny_args

MICRO_BATCH = 4


def _check_ring_attention(rank: int, size: int) -> list[str]:
    """Same random q/k/v on every rank; each rank feeds its shard to ring attention over the world and compares
    with its shard of full causal SDPA, in float64 (tight) and bf16 (fp32 inside, so close to the fp32 reference).
    Returns the failures (raising between the ring's collectives would leave the other ranks waiting)."""
    g = torch.Generator().manual_seed(7)
    b, hq, hkv, s, d = 2, 4, 2, 8 * size, 8
    q, k, v = (
        torch.randn(b, h, s, d, generator=g, dtype=torch.float64, requires_grad=True) for h in (hq, hkv, hkv)
    )
    dout = torch.randn(b, hq, s, d, generator=g, dtype=torch.float64)
    ref = causal_sdpa(q, k, v)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    failures = []
    for lb in (True, False):
        ring = RingAttention(None, load_balance=lb)

        def shard(t: torch.Tensor, dt: torch.dtype = torch.float64, lb: bool = lb) -> torch.Tensor:
            return cp_split(t.detach(), rank, size, lb, dim=2).to(dt)

        for dt, tol in ((torch.float64, 1e-12), (torch.bfloat16, 2e-2)):
            ql, kl, vl = (shard(t, dt).requires_grad_() for t in (q, k, v))
            out = ring(ql, kl, vl)
            got = (out, *torch.autograd.grad(out, (ql, kl, vl), shard(dout, dt)))
            if out.dtype != dt:
                failures.append(f"lb={lb}: ring attention returned {out.dtype} for {dt} inputs")
            for name, a, want in zip(("out", "dq", "dk", "dv"), got, (ref, *ref_grads)):
                try:
                    torch.testing.assert_close(a.double(), shard(want), rtol=tol, atol=tol)
                except AssertionError as e:
                    failures.append(f"{name} lb={lb} {dt}: {e}")
    return failures


class _RingBlock(nn.Module):
    """q/k/v projections, ring attention and an element-wise op after it: the shape of a block's attention."""

    def __init__(self, ring: RingAttention):
        super().__init__()
        torch.manual_seed(3)
        self.qkv, self.ring = nn.Linear(8, 24, dtype=torch.float64), ring

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (2, 4)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return torch.tanh(self.ring(q, k, v)).sum()


def _count_ring_work(rank: int, size: int) -> dict:
    """Ring forwards and K/V exchanges of one block's forward and backward under each recompute policy, and its
    gradients. Selective recompute keeps the ring op's output (it is one op in SAVED_OPS), so its backward runs
    no second ring forward and no second K/V exchange; full recompute runs both again."""
    counts, grads = {}, {}
    forward, exchange = cp._ring_forward, cp._Ring.exchange
    calls = {"forward": 0, "exchange": 0}

    def counted_forward(*a):
        calls["forward"] += 1
        return forward(*a)

    def counted_exchange(self, send, tag):
        calls["exchange"] += tag == cp._TAG_KV
        return exchange(self, send, tag)

    cp._ring_forward, cp._Ring.exchange = counted_forward, counted_exchange
    try:
        x = torch.randn(2, 4 * size, 8, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
        for mode in ("none", "selective", "full"):
            block = _RingBlock(RingAttention(None, load_balance=True))
            if mode != "none":
                checkpoint_forward(block, mode)
            calls.update(forward=0, exchange=0)
            block(x).backward()
            counts[mode] = dict(calls)
            grads[mode] = block.qkv.weight.grad
    finally:
        cp._ring_forward, cp._Ring.exchange = forward, exchange
    return {"counts": counts, "bitwise": {m: bool(torch.equal(g, grads["none"])) for m, g in grads.items()}}


def cp_case(rank: int, world_size: int, spec: dict | str) -> dict:
    """ "ring": ring attention against full SDPA; "recompute": the ring's work under each recompute policy;
    otherwise a training layout (ParallelConfig fields)."""
    if spec == "ring":
        return {"errors": _check_ring_attention(rank, world_size)}
    if spec == "recompute":
        return {"facts": _count_ring_work(rank, world_size)}
    return layout_case(rank, world_size, {**spec, "micro_batch": MICRO_BATCH})


# Every sequence split over the cp ranks, zig-zag (load-balanced) or contiguous; dp2 x cp2 averages the gradients
# over all four ranks (DDP over dp_cp).
CASES_2 = {
    "ring": "ring",
    "recompute": "recompute",
    "cp2_zigzag": dict(cp=2, cp_load_balance=True),
    "cp2_contiguous": dict(cp=2, cp_load_balance=False),
}
CASES_4 = {"ring": "ring", "dp2_cp2": dict(dp_shard=2, cp=2)}
SEQ = tiny_args().max_seq_len  # 32


@pytest.fixture(scope="module")
def results_2(tmp_path_factory):
    return run_layouts(tmp_path_factory, 2, CASES_2, cp_case)


@pytest.fixture(scope="module")
def results_4(tmp_path_factory):
    return run_layouts(tmp_path_factory, 4, CASES_4, cp_case)


@pytest.mark.parametrize("results", ["results_2", "results_4"])
def test_ring_attention_matches_full_attention(results, request):
    check_equivalent(request.getfixturevalue(results), "ring")


def test_selective_recompute_keeps_the_ring_and_full_recompute_reruns_it(results_2):
    for facts in check_equivalent(results_2, "recompute"):
        # One ring forward per forward pass and cp - 1 = 1 K/V exchange in it, plus 1 in the backward's own ring.
        assert facts["counts"] == {
            "none": {"forward": 1, "exchange": 2},
            "selective": {"forward": 1, "exchange": 2},
            "full": {"forward": 2, "exchange": 3},
        }
        assert facts["bitwise"] == {"none": True, "selective": True, "full": True}


def _span(*ranges: tuple[int, int]) -> list[int]:
    return [i for a, b in ranges for i in range(a, b)]


# The original positions each cp rank holds of a 32-token sequence. Zig-zag cuts it into 4 chunks and gives rank r
# chunks r and 3-r (so both ranks do the same causal work); contiguous gives rank r the r-th half.
POSITIONS = {
    "zigzag": [_span((0, 8), (24, 32)), _span((8, 24))],
    "contiguous": [_span((0, 16)), _span((16, 32))],
}


@pytest.mark.parametrize("name", ["cp2_zigzag", "cp2_contiguous"])
def test_cp2_training_matches_reference(results_2, name):
    for rank, facts in enumerate(check_equivalent(results_2, name)):
        # Each rank ran ring attention on its half of every sequence, with those tokens' original positions.
        assert facts["attention"] == "RingAttention" and facts["block_input_len"] == SEQ // 2
        assert facts["positions"] == POSITIONS[name.split("_")[1]][rank]
        # Whole replicas on both ranks (DDP over cp), bitwise equal, and the check would have seen one ulp.
        assert facts["replica_check_catches"] is True


def test_dp2_cp2_training_matches_reference(results_4):
    for rank, facts in enumerate(check_equivalent(results_4, "dp2_cp2")):
        assert facts["attention"] == "RingAttention" and facts["block_input_len"] == SEQ // 2
        # Mesh order (dp_shard, cp): the cp coordinate is the last of the rank.
        assert facts["positions"] == POSITIONS["zigzag"][rank % 2]
        assert facts["replica_check_catches"] is True
