"""Ring attention's math in one process: the sequence layouts, and the block-wise online-softmax combine with
causal masking by original positions, run over simulated ranks, against full causal SDPA (float64)."""

from __future__ import annotations

import pytest
import torch

from scaletrain.models.attention import causal_sdpa
from scaletrain.parallel.context_parallel import (
    attention_block_backward,
    attention_block_forward,
    block_plan,
    causal_work,
    compute_dtype,
    cp_positions,
    cp_split,
    merge_block,
)


def test_zigzag_and_contiguous_layouts():
    assert cp_positions(8, 0, 2, True).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 1, 2, True).tolist() == [2, 3, 4, 5]
    assert cp_positions(8, 1, 2, False).tolist() == [4, 5, 6, 7]
    for lb in (True, False):
        allpos = torch.cat([cp_positions(24, r, 3, lb) for r in range(3)])
        assert sorted(allpos.tolist()) == list(range(24))
    x = torch.arange(16).view(2, 8)
    assert cp_split(x, 0, 2, True).tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]


def test_zigzag_balances_causal_work():
    balanced = {causal_work(64, r, 4, True) for r in range(4)}
    assert len(balanced) == 1
    contiguous = [causal_work(64, r, 4, False) for r in range(4)]
    assert contiguous[-1] > 5 * contiguous[0]


@pytest.mark.parametrize("seq_len,cp,lb,need", [(12, 4, True, "2·cp = 8"), (10, 4, False, "cp = 4")])
def test_indivisible_sequence_is_refused_with_the_fix(seq_len, cp, lb, need):
    with pytest.raises(ValueError, match=need) as e:
        cp_split(torch.zeros(1, seq_len), 0, cp, lb)
    assert "data.seq_len" in str(e.value)


def test_block_plans_skip_future_and_drop_masks_when_fully_visible():
    # contiguous, cp=2: rank 0's queries never see rank 1's block; rank 1 sees rank 0's block whole
    assert block_plan(cp_positions(8, 0, 2, False), cp_positions(8, 1, 2, False)) is None
    full = block_plan(cp_positions(8, 1, 2, False), cp_positions(8, 0, 2, False))
    assert full.mask is None and (full.q_start, full.k_end) == (0, 4)
    # zig-zag, cp=4: an earlier rank's block costs half (its first chunk, unmasked), a later one too (second
    # half of the queries against the whole block, unmasked)
    q = cp_positions(32, 1, 4, True)
    early, late = block_plan(q, cp_positions(32, 0, 4, True)), block_plan(q, cp_positions(32, 2, 4, True))
    assert early.mask is None and (early.q_start, early.k_end) == (0, 4)
    assert late.mask is None and (late.q_start, late.k_end) == (4, 8)
    own = block_plan(q, q)
    assert own.mask is not None and own.mask.shape == (8, 8)


def _simulate_ring(q, k, v, dout, cp, lb):
    """Every rank's forward and backward over all cp blocks with the module's block functions; returns the
    per-rank out, dq, and dk/dv summed into their owners (what the ring's accumulators deliver)."""
    b, hq, s, d = q.shape
    hkv, scale = k.shape[1], d**-0.5
    shard = [[cp_split(t, r, cp, lb, dim=2) for t in (q, k, v, dout)] for r in range(cp)]
    pos = [cp_positions(s, r, cp, lb) for r in range(cp)]
    outs, dqs = [], []
    dks = [torch.zeros_like(shard[r][1]) for r in range(cp)]
    dvs = [torch.zeros_like(shard[r][2]) for r in range(cp)]
    for r in range(cp):
        qg = shard[r][0].unflatten(1, (hkv, -1))
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=q.dtype)
        plans = [(src, block_plan(pos[r], pos[(src)])) for src in ((r - i) % cp for i in range(cp))]
        for src, plan in plans:
            if plan is not None:
                merge_block(
                    out,
                    lse,
                    *attention_block_forward(qg, shard[src][1], shard[src][2], plan, scale),
                    plan.q_start,
                )
        dog = shard[r][3].unflatten(1, (hkv, -1))
        delta = (dog * out).sum(-1)
        dq = torch.zeros_like(qg)
        for src, plan in plans:
            if plan is None:
                continue
            dq_b, dk_b, dv_b = attention_block_backward(
                qg, shard[src][1], shard[src][2], dog, lse, delta, plan, scale
            )
            dq[..., plan.q_start :, :] += dq_b
            dks[src][..., : plan.k_end, :] += dk_b
            dvs[src][..., : plan.k_end, :] += dv_b
        outs.append(out.flatten(1, 2))
        dqs.append(dq.flatten(1, 2))
    return outs, dqs, dks, dvs


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("lb", [True, False], ids=["zigzag", "contiguous"])
def test_blockwise_ring_math_equals_full_causal_sdpa(cp, lb):
    g = torch.Generator().manual_seed(cp)
    b, hq, hkv, s, d = 2, 4, 2, 8 * cp, 8
    q, k, v = (
        torch.randn(b, h, s, d, generator=g, dtype=torch.float64, requires_grad=True) for h in (hq, hkv, hkv)
    )
    dout = torch.randn(b, hq, s, d, generator=g, dtype=torch.float64)
    ref = causal_sdpa(q, k, v)
    ref_dq, ref_dk, ref_dv = torch.autograd.grad(ref, (q, k, v), dout)
    outs, dqs, dks, dvs = _simulate_ring(q.detach(), k.detach(), v.detach(), dout, cp, lb)
    for r in range(cp):
        for got, want in ((outs[r], ref), (dqs[r], ref_dq), (dks[r], ref_dk), (dvs[r], ref_dv)):
            torch.testing.assert_close(got, cp_split(want.detach(), r, cp, lb, dim=2), rtol=1e-10, atol=1e-10)


def test_sixteen_bit_inputs_compute_in_fp32():
    assert compute_dtype(torch.bfloat16) is torch.float32 and compute_dtype(torch.float16) is torch.float32
    assert compute_dtype(torch.float64) is torch.float64
