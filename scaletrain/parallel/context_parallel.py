"""Context parallel (CP): each sequence is split over the `cp` ranks of a group, and causal attention runs as ring
attention built on `torch.distributed` point-to-point ops, so the same code runs on gloo (CPU) and NCCL (GPU).

Only attention needs the whole sequence; every other layer works token by token on the local shard. Integration
(for the train step): the model gets `apply_cp` once; each batch goes through `cp_shard_batch`, and the model is
called as `model(inputs_local, positions=positions_local)` so that RoPE sees the original token positions. Each
cp rank's loss is the mean over its local tokens (all ranks hold the same number), so the full-sequence loss is the
mean of the cp ranks' losses, and the full-sequence gradient is the MEAN of the cp ranks' parameter gradients: ring
attention's backward returns to each rank the gradients of its own K/V from every rank's queries, so the sum of
the ranks' gradients is cp times the full one. Averaging over cp is therefore exactly what data parallelism
already does: DDP or FSDP over the flattened dp×cp mesh (or an all-reduce over the cp group divided by cp) gives
the full-sequence, full-batch gradient. Logged losses must likewise be averaged over cp.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

CPBackend = Literal["ring-p2p"]

# gloo matches a receive to a send by (peer, tag): K/V blocks and gradient accumulators are in flight at the same
# time during backward, so they travel under different tags. NCCL ignores tags and matches by issue order, which
# is the same on every rank because every rank runs the same loop.
_TAG_KV, _TAG_DKV = 0, 1


# ---------------------------------------------------------------------------------------------------------------
# Sequence layout


def _chunks_per_rank(load_balance: bool) -> int:
    return 2 if load_balance else 1


def cp_positions(seq_len: int, cp_rank: int, cp_size: int, load_balance: bool) -> torch.Tensor:
    """Original positions (ascending, LongTensor on CPU) of the tokens that `cp_rank` holds.

    With load balancing the sequence is cut into 2·cp chunks and rank r takes chunks r and 2·cp−1−r ("zig-zag"):
    under a causal mask a late chunk attends to many keys and an early one to few, so pairing them gives every rank
    the same attention work (Brandon et al. 2023, "Striped Attention", on the imbalance; the Llama 3 paper, Dubey et
    al. 2024 §3.3.2, uses this 2·cp chunk pairing). Without it, rank r holds the r-th contiguous chunk and the last
    rank does about 2·cp−1 times the work of the first."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"context parallel: rank {cp_rank} is outside a group of {cp_size} ranks")
    n_chunks = cp_size * _chunks_per_rank(load_balance)
    if seq_len % n_chunks:
        fit = -(-seq_len // n_chunks) * n_chunks
        what = f"2·cp = {n_chunks} (load-balanced zig-zag layout)" if load_balance else f"cp = {n_chunks}"
        raise ValueError(
            f"context parallel: sequence length {seq_len} is not divisible by {what}. Set data.seq_len "
            f"to a multiple of {n_chunks} (e.g. {fit}), or change parallel.cp."
        )
    chunk = seq_len // n_chunks
    ids = [cp_rank, n_chunks - 1 - cp_rank] if load_balance else [cp_rank]
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk) for i in ids])


def cp_split(
    tokens_or_targets: torch.Tensor, cp_rank: int, cp_size: int, load_balance: bool, *, dim: int = 1
) -> torch.Tensor:
    """This rank's share of a batch along the sequence dimension (`dim`, 1 for [batch, seq]), in the layout of
    `cp_positions`."""
    pos = cp_positions(tokens_or_targets.shape[dim], cp_rank, cp_size, load_balance)
    return tokens_or_targets.index_select(dim, pos.to(tokens_or_targets.device))


# ---------------------------------------------------------------------------------------------------------------
# Block-wise attention math (single process; the ring below only moves blocks around)


@dataclass(frozen=True)
class BlockPlan:
    """How the local queries attend to one K/V block, derived from original positions (both sorted ascending):
    queries before `q_start` see none of the block, keys from `k_end` on are seen by no query, and `mask`
    ([n_q - q_start, k_end], True = may attend) is None when every remaining pair is visible."""

    q_start: int
    k_end: int
    mask: torch.Tensor | None


def block_plan(
    q_pos: torch.Tensor, k_pos: torch.Tensor, device: torch.device | None = None
) -> BlockPlan | None:
    """Causal visibility by original positions (query may see key iff q_pos >= k_pos); None when the block lies
    entirely in the queries' future and can be skipped. Both layouts give sorted positions, so the visible queries
    are a suffix and the visible keys a prefix: slicing to them is what makes zig-zag blocks cost half (one half
    of the queries sees the whole block, or all queries see one half of it, with no mask)."""
    assert bool((q_pos[1:] > q_pos[:-1]).all()) and bool((k_pos[1:] > k_pos[:-1]).all()), (
        "positions must ascend"
    )
    k_end = int(torch.searchsorted(k_pos, q_pos[-1], right=True))
    q_start = int(torch.searchsorted(q_pos, k_pos[0]))
    if k_end == 0 or q_start == len(q_pos):
        return None
    mask = None
    if q_pos[q_start] < k_pos[k_end - 1]:
        mask = (q_pos[q_start:, None] >= k_pos[None, :k_end]).to(device)
    return BlockPlan(q_start, k_end, mask)


def _scores(q: torch.Tensor, k: torch.Tensor, plan: BlockPlan, scale: float) -> torch.Tensor:
    # Grouped-query layout: q is [batch, kv_heads, group, seq, dim], k is [batch, kv_heads, seq, dim]; query head
    # h uses kv head h // group, as SDPA's enable_gqa (repeat_interleave) does, without materialising repeats.
    s = torch.einsum("bhgqd,bhkd->bhgqk", q[..., plan.q_start :, :], k[..., : plan.k_end, :]) * scale
    return s if plan.mask is None else s.masked_fill(~plan.mask, float("-inf"))


def attention_block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the queries from `plan.q_start` on to one block: (out, log-sum-exp of the scores)."""
    s = _scores(q, k, plan, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhgqk,bhkd->bhgqd", torch.exp(s - lse.unsqueeze(-1)), v[..., : plan.k_end, :])
    return out, lse


@torch.no_grad()
def merge_block(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor, q_start: int
) -> None:
    """Fold one block's partial result into the running one, in place: the online softmax with log-sum-exp
    (Milakov & Gimelshein 2018; Liu et al. 2023, "Ring Attention"). out = Σ_b exp(lse_b − lse)·out_b, where
    lse = log Σ_b exp(lse_b); start from out = 0, lse = −inf."""
    o, m = out[..., q_start:, :], lse[..., q_start:]
    new = torch.logaddexp(m, block_lse)
    o.mul_(torch.exp(m - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    m.copy_(new)


def attention_block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    plan: BlockPlan,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients through one block, recomputed from q/k/v and the final lse (FlashAttention-2's backward, Dao
    2023): P = exp(S − lse), dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − delta) with delta = rowsum(dO ∘ O). Returns dq for the
    queries from `plan.q_start` on, and dk/dv for the first `plan.k_end` keys (summed over each kv head's group)."""
    qs, ks, vs = q[..., plan.q_start :, :], k[..., : plan.k_end, :], v[..., : plan.k_end, :]
    do = dout[..., plan.q_start :, :]
    p = torch.exp(_scores(q, k, plan, scale) - lse[..., plan.q_start :].unsqueeze(-1))
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, do)
    ds = p * (torch.einsum("bhgqd,bhkd->bhgqk", do, vs) - delta[..., plan.q_start :].unsqueeze(-1))
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, ks) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, qs) * scale
    return dq, dk, dv


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit inputs: the online softmax rescales and adds one partial output per ring step, and the
    backward forms dO·Vᵀ − rowsum(dO∘O), a difference of nearly equal numbers; in bf16 (8-bit mantissa) each hop
    would round and the error would grow with cp. K/V still travel in their own dtype (half the bytes)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


# ---------------------------------------------------------------------------------------------------------------
# The ring


class _Pending:
    """A receive in flight (or, on a one-rank ring, a value already at hand)."""

    def __init__(self, works: list, value: torch.Tensor):
        self.works, self.value = works, value

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        return self.value


@dataclass
class _Ring:
    group: dist.ProcessGroup | None
    rank: int
    size: int
    plans: list[BlockPlan | None]  # plans[i]: local queries vs the block of rank (rank − i) mod size

    def exchange(self, send: torch.Tensor, tag: int) -> _Pending:
        """Send `send` to the next rank and receive the previous rank's tensor of the same shape, asynchronously."""
        if self.size == 1:
            return _Pending([], send)
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, group=self.group, group_peer=(self.rank + 1) % self.size, tag=tag),
            dist.P2POp(dist.irecv, recv, group=self.group, group_peer=(self.rank - 1) % self.size, tag=tag),
        ]
        return _Pending(dist.batch_isend_irecv(ops), recv)


def _grouped(t: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).unflatten(1, (kv_heads, t.shape[1] // kv_heads))


def _ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring
) -> tuple[torch.Tensor, torch.Tensor]:
    cdt, scale = compute_dtype(q.dtype), q.shape[-1] ** -0.5
    qg = _grouped(q, k.shape[1], cdt)
    out = torch.zeros_like(qg)
    lse = torch.full(qg.shape[:-1], float("-inf"), dtype=cdt, device=q.device)
    kv = torch.stack([k, v])
    for step, plan in enumerate(ring.plans):
        # Start moving the block on before computing with it: the transfer overlaps this block's compute.
        nxt = ring.exchange(kv, _TAG_KV) if step < ring.size - 1 else None
        if plan is not None:
            kc, vc = kv.to(cdt).unbind(0)
            merge_block(out, lse, *attention_block_forward(qg, kc, vc, plan, scale), plan.q_start)
        if nxt is not None:
            kv = nxt.wait()
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)


def _ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    ring: _Ring,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V go round the ring again, each followed by its gradient accumulator: at step i rank r holds the block of
    rank r−i together with what ranks r−i .. r−1 added to its dK/dV, adds its own queries' share and passes both
    on; one last hop after the final step brings each accumulator home to the block's owner."""
    hkv, cdt, scale = k.shape[1], compute_dtype(q.dtype), q.shape[-1] ** -0.5
    qg, dog = _grouped(q, hkv, cdt), _grouped(dout, hkv, cdt)
    delta = (dog * _grouped(out, hkv, cdt)).sum(-1)
    lseg = lse.unflatten(1, (hkv, -1))
    dq = torch.zeros_like(qg)
    kv = torch.stack([k, v])
    acc_in: _Pending | None = None
    for step, plan in enumerate(ring.plans):
        nxt = ring.exchange(kv, _TAG_KV) if step < ring.size - 1 else None
        dkv = torch.zeros(kv.shape, dtype=cdt, device=kv.device)
        if plan is not None:
            kc, vc = kv.to(cdt).unbind(0)
            dq_b, dk_b, dv_b = attention_block_backward(qg, kc, vc, dog, lseg, delta, plan, scale)
            dq[..., plan.q_start :, :] += dq_b
            dkv[0, ..., : plan.k_end, :] += dk_b
            dkv[1, ..., : plan.k_end, :] += dv_b
        if acc_in is not None:
            dkv += acc_in.wait()  # the earlier ranks' share for this block, received during the compute above
        acc_in = ring.exchange(dkv, _TAG_DKV)
        if nxt is not None:
            kv = nxt.wait()
    dk, dv = acc_in.wait().unbind(0)
    return dq.flatten(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# Ring attention is one registered op, not an autograd.Function: selective recompute (parallel/recompute.py) then
# sees it as a single op and keeps its outputs, so the backward neither re-runs the ring's forward nor repeats its
# K/V exchange (inside a Function, every einsum and p2p op would be dispatched, and all but the matmuls re-run).
# Custom ops take tensors and plain values only: the op gets its ring (group and block plans) by index.
_RINGS: list[_Ring] = []


@torch.library.custom_op("scaletrain::ring_attention", mutates_args=())
def ring_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, the log-sum-exp in the compute dtype) of causal ring attention over `_RINGS[ring]`."""
    # Autocast would recast the fp32 internals to bf16: this kernel chooses its own precision.
    with torch.autocast(q.device.type, enabled=False):
        return _ring_forward(q, k, v, _RINGS[ring])


@ring_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=compute_dtype(q.dtype))


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    # As FlashAttention does, keep out in the input dtype and lse in fp32; backward recomputes the rest.
    q, k, v, ring = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.ring = ring


def _backward(ctx, dout: torch.Tensor, _dlse: torch.Tensor | None):
    q, k, v, out, lse = ctx.saved_tensors
    with torch.autocast(q.device.type, enabled=False):
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, _RINGS[ctx.ring])
    return dq, dk, dv, None


ring_attention_op.register_autograd(_backward, setup_context=_setup_context)


class RingAttention:
    """Causal ring attention over a context-parallel process group, as the model's `sdpa` callable:
    `fn(q, k, v) -> out` on [batch, heads, local_seq, head_dim] (k/v may have fewer heads: GQA). Each rank holds
    the tokens `cp_positions` gives it; masking uses those original positions, so both layouts are exact."""

    def __init__(self, group: dist.ProcessGroup | None, *, load_balance: bool):
        self.group, self.load_balance = group, load_balance
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._rings: dict[tuple[int, torch.device], int] = {}

    def _ring(self, local_len: int, device: torch.device) -> int:
        """The index in `_RINGS` of the ring for `local_len` local tokens on `device` (built on first use)."""
        key = (local_len, device)
        if key not in self._rings:
            seq = local_len * self.size
            q_pos = cp_positions(seq, self.rank, self.size, self.load_balance)
            plans = [
                block_plan(
                    q_pos,
                    cp_positions(seq, (self.rank - i) % self.size, self.size, self.load_balance),
                    device,
                )
                for i in range(self.size)
            ]
            _RINGS.append(_Ring(self.group, self.rank, self.size, plans))
            self._rings[key] = len(_RINGS) - 1
        return self._rings[key]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.shape[2] != q.shape[2] or q.shape[1] % k.shape[1]:
            raise ValueError(
                f"ring attention needs self-attention shapes with kv heads dividing q heads; got q "
                f"{tuple(q.shape)}, k {tuple(k.shape)}"
            )
        return ring_attention_op(q, k, v, self._ring(q.shape[2], q.device))[0]


# ---------------------------------------------------------------------------------------------------------------
# Applying it


def select_cp_backend(device: torch.device | str) -> CPBackend:
    """Which context-parallel attention runs: always "ring-p2p", ours, on CPU and on CUDA.

    PyTorch's own `torch.distributed.tensor.experimental.context_parallel` intercepts only the CUDA SDPA kernels
    (flash, memory-efficient, cuDNN), so on CPU it cannot run at all. On CUDA it would run, but it is not a drop-in
    here: it is a context manager that shards given buffers in place and monkey-patches
    `F.scaled_dot_product_attention` around forward and backward, applies its own load balancer instead of taking
    positions, and cannot be tested on this project's CPU-only CI. Until a GPU test proves it equal to this path,
    CUDA also runs ring-p2p (over NCCL point-to-point). Its cost there: block attention is computed with einsum
    and a materialised [local_seq, local_seq] score block per step, not a fused flash kernel."""
    return "ring-p2p"


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, *, load_balance: bool) -> nn.Module:
    """Swap every layer's attention kernel for ring attention over `cp_mesh` (1-D). Apply before DDP/FSDP
    wrapping; each batch goes through `cp_shard_batch`, whose `positions=` the model gets (from the caller, or
    from a pre-hook when a pipeline schedule calls it), and gradients are averaged over cp (module docstring)."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    backend = select_cp_backend(device)
    ring = RingAttention(cp_mesh.get_group(), load_balance=load_balance)
    for layer in model.layers.values():
        layer.attention.sdpa = ring
    # A pipeline stage is called by the schedule with its input only: the hook supplies the original positions of
    # this rank's tokens wherever the caller did not, so RoPE is right on every stage (and in evaluation).
    model.register_forward_pre_hook(
        _original_positions(cp_mesh.get_local_rank(), cp_mesh.size(), load_balance), with_kwargs=True
    )
    log.info(
        "applied context parallel over %d ranks: %s attention on %s, %s layout",
        cp_mesh.size(),
        backend,
        device.type,
        "zig-zag load-balanced" if load_balance else "contiguous",
    )
    return model


def _original_positions(cp_rank: int, cp_size: int, load_balance: bool):
    """A forward pre-hook that passes `positions=` (those of `cp_positions` for a sequence of cp_size times the
    local length) when the call gave none."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("positions") is None:
            local = args[0].shape[1]
            pos = cp_positions(local * cp_size, cp_rank, cp_size, load_balance)
            kwargs = {**kwargs, "positions": pos.to(args[0].device)}
        return args, kwargs

    return hook


def cp_shard_batch(
    inputs: torch.Tensor, targets: torch.Tensor, cp_mesh: DeviceMesh, load_balance: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This cp rank's (inputs, targets, positions) for a [batch, seq] batch; pass `positions=` to the model."""
    rank, size = cp_mesh.get_local_rank(), cp_mesh.size()
    pos = cp_positions(inputs.shape[1], rank, size, load_balance).to(inputs.device)
    return inputs.index_select(1, pos), targets.index_select(1, pos), pos


def causal_work(seq_len: int, cp_rank: int, cp_size: int, load_balance: bool) -> int:
    """Query-key pairs rank `cp_rank` computes under the causal mask (equal on every rank when load-balanced)."""
    q_pos = cp_positions(seq_len, cp_rank, cp_size, load_balance)
    return int((q_pos + 1).sum())


__all__ = [
    "BlockPlan",
    "RingAttention",
    "apply_cp",
    "attention_block_backward",
    "attention_block_forward",
    "block_plan",
    "causal_work",
    "compute_dtype",
    "cp_positions",
    "cp_shard_batch",
    "cp_split",
    "merge_block",
    "select_cp_backend",
]
