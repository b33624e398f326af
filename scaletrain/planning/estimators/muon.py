"""Muon's share of a step (optimizer.name = "muon", optim/muon.py, issue 40): the Newton-Schulz FLOPs of the hidden
matrices split over the ranks that share them, the exchange that brings each matrix to its owner and the result
back, and the part of that exchange the next bucket's orthogonalisation does not hide. The element-wise work of the
momentum is left in the AdamW traffic the time model already counts for every parameter (within ~30% of it)."""

from __future__ import annotations

import math
from collections.abc import Callable

from scaletrain.models.llama import ModelArgs
from scaletrain.models.moe import is_moe_layer
from scaletrain.optim.muon import BUCKET_BYTES, newton_schulz_flops
from scaletrain.parallel.layout import Layout

# Each iteration of newton_schulz is three matmuls (X Xᵀ, A², B X), each paying the device's per-call cost.
MATMULS_PER_ITERATION = 3


def hidden_shapes(args: ModelArgs) -> list[tuple[int, ...]]:
    """Every matrix Muon steps (muon.hidden_matrices), whole: attention's four (MHA/GQA shapes; MLA's are not
    counted apart), a dense block's SwiGLU three, a MoE block's three stacks of routed experts, its router and its
    shared experts' three."""
    q, kv, h = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.dim
    out: list[tuple[int, ...]] = []
    for i in range(args.n_layers):
        out += [(q, h), (kv, h), (kv, h), (h, q)]
        if is_moe_layer(args, i):
            e, f = args.n_experts, args.moe_hidden or args.ffn_hidden
            out += [(e, f, h), (e, h, f), (e, f, h), (e, h)]
            if args.shared_experts:
                s = f * args.shared_experts
                out += [(s, h), (h, s), (s, h)]
        else:
            out += [(args.ffn_hidden, h), (h, args.ffn_hidden), (args.ffn_hidden, h)]
    return out


def muon_ranks(dims: Layout) -> int:
    """The ranks that split one stage's Newton-Schulz work: the data-parallel ranks of ddp and zero1 (whole
    matrices on each), the shard group of fsdp, zero2 and hsdp (whose replicas each repeat their group's work),
    and under tp x fsdp the whole stage (the general path takes owners in turn over the mesh)."""
    mode = dims.parallel.data_parallel
    if mode in ("ddp", "zero1"):
        return dims.size("dp_cp")
    return dims.size("dp_shard_cp") * dims.tp


def muon_step_s(
    args: ModelArgs,
    dims: Layout,
    ns_steps: int,
    matmul: tuple[float, float],
    exchange_s: Callable[[int, float], float],
    call_s: float,
) -> dict[str, float]:
    """Seconds Muon adds to one rank's step: {"muon_ns_s", "muon_comm_s", "muon_s"} (the last the exposed total).

    Newton-Schulz: FLOPs / n ranks at the fp32 matmul rate `matmul` = (t0, FLOP/s), one stage's matrices (pp).
    Exchange, fp32: fsdp-like layouts send each rank's shards to the owners and the results back (two all-to-alls
    in which each rank receives ~1/n of the matrices whole); ddp gathers every result on every rank (one
    all_gather); zero1 exchanges nothing here (its broadcast of the stepped parameters is AdamW's too). The next
    bucket travels while this one is orthogonalised: all but one bucket's exchange hides behind the FLOPs where
    they are longer. `exchange_s(n, size)`: seconds of an all_gather into `size` bytes over n ranks on the group's
    link (an all-to-all of `size` bytes per rank moves as much: (n-1)/n of it in n-1 exchanges). `call_s`: the
    fixed cost of one collective call (CPUs), paid per bucket."""
    shapes = hidden_shapes(args)
    share = 1 / dims.pp
    n = muon_ranks(dims)
    t0, rate = matmul
    flops = share * sum(newton_schulz_flops(s, ns_steps) for s in shapes)
    calls = share * len(shapes) * ns_steps * MATMULS_PER_ITERATION
    ns = (flops / rate + calls * t0) / n
    size = 4 * share * sum(math.prod(s) for s in shapes)
    buckets = max(1, math.ceil(size / BUCKET_BYTES))
    mode = dims.parallel.data_parallel
    if n <= 1 or mode == "zero1":
        comm = 0.0
    elif mode == "ddp":
        comm = exchange_s(n, size) + buckets * call_s
    else:
        comm = 2 * exchange_s(n, size / n) + 2 * buckets * call_s
    exposed = max(0.0, comm - ns) + comm / buckets
    return {"muon_ns_s": ns, "muon_comm_s": comm, "muon_s": ns + min(comm, exposed)}
