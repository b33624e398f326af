"""Predicted step time of one layout on one device profile, by part: compute from FLOPs at the rate the device
reaches for matmuls of each shape, every collective from its message sizes and link, the pipeline bubble of the
schedule, and what each parallelism lets overlap. docs/planner.md states the formulas and what they leave out."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from scaletrain.config import MemoryConfig, OptimizerConfig, ParallelConfig, TrainingConfig
from scaletrain.metrics.mfu import attended_keys, model_flops_per_token
from scaletrain.models.llama import ModelArgs, layer_window
from scaletrain.parallel.layout import Layout, resolve_microbatches
from scaletrain.parallel.pipeline import stages_per_rank
from scaletrain.planning.estimators.hardware import DeviceProfile
from scaletrain.planning.estimators.memory import block_parameters, compute_bytes_of, layer_activation_bytes
from scaletrain.planning.estimators.moe import dispatch_bytes, ffn_shape
from scaletrain.planning.estimators.muon import muon_ranks, muon_step_s
from scaletrain.precision.policy import mfu_precision

# Share of a block's element-wise forward that selective recompute runs again in backward: the norms, RoPE,
# SiLU and the gate multiply (the matmuls and attention are kept), about a third of its element-wise traffic.
SELECTIVE_SHARE = 1 / 3
# Element-wise traffic of an eager block per byte it saves for backward. Counted for our block: each RMSNorm runs
# ~10 passes over an h-sized fp32 tensor (upcast, pow, mean, rsqrt, mul, cast, weight), RoPE ~5 over q and k,
# SwiGLU ~5 over f-sized tensors, and backward about twice forward: ~10x the saved bytes in all (for the 8B shape
# 2.0 MB per token and layer against 0.18 MB saved). A rough count; on a CPU the calibrated fit absorbs its error.
ELEMENTWISE_TRAFFIC = 10.0
# Fused attention on a GPU, as measured by FlashAttention-3's authors on an H100 SXM5 in bf16, head dim 128,
# sequence 8k (Shah et al. 2024, arXiv:2407.08608, its forward and backward speed figures): FlashAttention-2 (what
# SDPA's flash backend runs; the planner's choice for model.attention = auto, flash and the others) 333 TFLOP/s
# forward with a causal mask and 318 backward; cuDNN (model.attention = cudnn, and Transformer Engine's fused
# attention) 529 and 518. As (forward, backward) shares of the 989.4 dense peak, applied to the profile's bf16
# peak. FLOPs as the kernels' authors count them: forward 4·s²·d·h (half under a causal mask), backward 2.5x forward
# (it recomputes QKᵀ; flash-attention's benchmarks/benchmark_flash_attention.py, flops()). CPUs: the calibrated
# block fit absorbs attention.
ATTENTION_SHARES = {"flash": (333 / 989.4, 318 / 989.4), "cudnn": (529 / 989.4, 518 / 989.4)}
ATTENTION_BACKWARD_FLOPS = 2.5
# AdamW per fp32 parameter: read p, g, m, v (16 bytes), write p, m, v (12 bytes).
ADAM_TRAFFIC = 28
# Autocast's casts (issue 24): each forward under bf16/fp16 autocast casts every Linear's fp32 weight to 16 bits
# (read 4 bytes, write 2) and backward casts its 16-bit weight gradient back to fp32 (read 2, write 4): 12 bytes per
# weight per micro-batch (the fp32 master copy is what makes them). The fp32 inputs of wq, wk, wv, w1 and w3 (the
# norms' fp32 outputs; each Linear casts its own) are cast too, and their gradients back: 12 bytes per element.
# wo and w2 take the 16-bit outputs of attention and SwiGLU, uncast. On the debug model these casts, not the
# matmuls, set bf16's pace (bench: 0.92x fp32's speed on a CPU with AVX512-BF16).
CAST_BYTES = 12
CAST_INPUTS = 5  # the Linear inputs of a block that autocast casts (wq, wk, wv, w1, w3)
CAST_CALLS = 2 * (7 + CAST_INPUTS)  # cast ops per block and micro-batch: forward and backward


@dataclass(frozen=True)
class Link:
    """Per-rank bandwidth (bytes/s, per direction) and latency per step of a collective."""

    bw: float
    latency: float


def all_reduce_s(n: int, size: float, link: Link) -> float:
    """Ring all-reduce of `size` bytes over n ranks: 2(n-1) steps, each rank sends 2(n-1)/n of the buffer
    (Patarasuk & Yuan 2009; NCCL's bus-bandwidth convention)."""
    return 0.0 if n <= 1 else 2 * (n - 1) * link.latency + 2 * (n - 1) / n * size / link.bw


def all_gather_s(n: int, size: float, link: Link) -> float:
    """Ring all-gather into `size` bytes (the gathered whole): n-1 steps of size/n each."""
    return 0.0 if n <= 1 else (n - 1) * link.latency + (n - 1) / n * size / link.bw


reduce_scatter_s = all_gather_s  # the same traffic in reverse: `size` is the whole input


def all_to_all_s(n: int, size: float, link: Link) -> float:
    """All-to-all of `size` bytes per rank: (n-1)/n of it leaves the rank, n-1 exchanges."""
    return 0.0 if n <= 1 else (n - 1) * link.latency + (n - 1) / n * size / link.bw


def p2p_s(size: float, link: Link) -> float:
    return link.latency + size / link.bw


def pipeline_bubble(schedule: str, pp: int, m: int, v: int = 1) -> float:
    """Idle time of a pipeline step as a multiple of its compute: (p-1)/m for GPipe and 1F1B, (p-1)/(v·m) for
    interleaved 1F1B with v stages per rank (Narayanan et al. 2021; the fraction of the whole step is then
    (p-1)/(v·m+p-1)). Zero bubble (Qi et al. 2023): splitting the weight gradient out of backward lets it fill the
    bubble; ZB-H1 leaves about a third of 1F1B's (interleaved_zb), and the V schedules (zbv, dualpipev) are taken
    as 0 once m >= 2p (their published near-zero case), else a third of interleaved's with v = 2."""
    if pp <= 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) / m
    if schedule == "interleaved_1f1b":
        return (pp - 1) / (v * m)
    if schedule == "interleaved_zb":
        return (pp - 1) / (v * m) / 3
    return 0.0 if m >= 2 * pp else (pp - 1) / (2 * m) / 3


def _exposed_bubble(profile: DeviceProfile, bubble: float, slow: float) -> float:
    """The bubble's share of the busy time that lengthens the step. On a CPU with more processes than cores (slow
    > 1), a stage idle in the fill or drain leaves its cores to the busy stages: the step lasts the longer of the
    busy time at the shared rate and the pipeline's critical path, busy x (1 + bubble), at the rate of whole
    cores (busy / slow). With a core per process, or on a GPU, the bubble is all idle time."""
    if profile.kind != "cpu":
        return bubble
    return max(0.0, (1 + bubble) / slow - 1)


def _slowdown(profile: DeviceProfile, share: float) -> float:
    """How many times longer a rank's fixed CPU work (dispatch, hooks) takes than on cores of its own: 1 on a GPU;
    on a CPU, more processes than cores share them."""
    return 1.0 / min(1.0, share * profile.threads) if profile.kind == "cpu" else 1.0


def _call_s(profile: DeviceProfile, n: int, slow: float) -> float:
    """The fixed seconds of one collective call over n ranks in a training step on a CPU (0 on a GPU, or n = 1):
    calibrated with as many processes as the nearest group size measured (so at that run's sharing of the cores),
    rescaled to this run's `slow`."""
    if profile.kind != "cpu" or n <= 1:
        return 0.0
    if not profile.call_by_ranks:
        return profile.collective_call_s * slow
    near = min(map(int, profile.call_by_ranks), key=lambda k: (abs(math.log(k / n)), -k))
    measured_slow = max(1.0, near * profile.threads / (profile.cores or 1))
    return profile.call_by_ranks[str(near)] / measured_slow * slow


def _cpu_share(profile: DeviceProfile, procs: int, threads: int) -> float:
    """How many of the profile's measured thread-rates one rank gets: 1 on a GPU; on a CPU its threads, capped at
    its share of the cores, over the threads the profile was measured with."""
    if profile.kind != "cpu":
        return 1.0
    cores = profile.cores or 1
    return min(threads, cores / procs) / profile.threads


@dataclass
class _Shape:
    """One rank's work for one micro-batch in one block: tokens, and the sizes tp and cp leave it."""

    tokens: float  # micro x seq_len / cp
    seq: int  # the whole sequence (ring attention sees all of it)
    h: int
    q: float  # query width / tp
    kv: float  # key/value width / tp
    f: float  # ffn hidden / tp
    keys: float = 0.0  # keys a query attends to, as the kernel runs (mfu.attended_keys); 0: seq / 2 (causal)
    v: float = 0.0  # value width / tp where it is not q's (MLA's v_head_dim); 0: q
    proj: tuple[
        float, ...
    ] = ()  # (in x out) of each attention projection where they are not wq, wk, wv, wo (MLA)


def mla_projections(args: ModelArgs) -> tuple[float, ...]:
    """(in x out) of each of MLA's projections (models/mla.py), in forward order: wq_a and wq_b (or wq), wkv_a,
    wkv_b, wo; their sum is memory.attention_parameters' matrices. Tensor parallel is refused for MLA."""
    heads, qk, v = args.n_heads, args.qk_nope_head_dim + args.qk_rope_head_dim, args.v_head_dim
    r_q, r_kv = args.q_lora_rank, args.kv_lora_rank
    q = (args.dim * r_q, r_q * heads * qk) if r_q else (args.dim * heads * qk,)
    kv = (args.dim * (r_kv + args.qk_rope_head_dim), r_kv * heads * (args.qk_nope_head_dim + v))
    return (*q, *kv, heads * v * args.dim)


def _matmuls(s: _Shape) -> list[float]:
    """Forward FLOPs of each matmul of one block: wq, wk, wv, wo, w1, w3, w2, and causal attention's QKᵀ and AV
    (half the square: the kernel skips the masked blocks; over cp the ring visits every chunk)."""
    t, h = s.tokens, s.h
    proj = [2 * t * h * s.q, 2 * t * h * s.kv, 2 * t * h * s.kv, 2 * t * s.q * h]
    if s.proj:
        proj = [2 * t * w for w in s.proj]
    mlp = [2 * t * h * s.f, 2 * t * h * s.f, 2 * t * s.f * h]
    keys = s.keys or s.seq / 2
    attention = [2 * t * keys * s.q, 2 * t * keys * (s.v or s.q)]
    return proj + mlp + attention


def _keys_as_run(args: ModelArgs, layer: int, seq_len: int, kind: str) -> float:
    """Keys per query layer `layer`'s kernel computes: a window's band where FlexAttention skips the masked blocks
    (CUDA), the whole square where a boolean mask goes to SDPA (CPU) and in GPT-OSS's sink attention."""
    window = layer_window(args, layer)
    whole = getattr(args, "attention_sinks", False) or (window > 0 and kind == "cpu")
    return attended_keys(seq_len, window, as_run=whole)


def _block_times(
    args: ModelArgs,
    p: ParallelConfig,
    profile: DeviceProfile,
    precision: str,
    micro: int,
    seq_len: int,
    share: float,
) -> dict[str, float]:
    """Seconds of one block's forward, backward and element-wise work for one micro-batch on one rank."""
    t0, rate = _matmul_rate(profile, precision)
    t0, rate = t0 * _slowdown(profile, share), rate * share  # a shared core dispatches slower too
    # fp8 turns only the blocks' nn.Linear layers into fp8 matmuls: attention stays a bf16 kernel, and so do the
    # routed experts (GroupedExperts holds stacked parameters, not Linear layers).
    hp_rate = _matmul_rate(profile, _not_fp8(precision))[1] * share
    ffn = ffn_shape(args)
    routed = (
        ffn.moe_share * getattr(args, "top_k", 0) * (args.moe_hidden or args.ffn_hidden) if ffn.routed else 0
    )
    x = routed / ffn.active_hidden  # the routed experts' share of a token's SwiGLU work
    mlp_rate = 1 / (x / hp_rate + (1 - x) / rate)
    shape = _Shape(
        tokens=micro * seq_len / p.cp,
        seq=seq_len,
        h=args.dim,
        q=args.n_heads * args.head_dim / p.tp,
        kv=args.n_kv_heads * args.head_dim / p.tp,
        f=ffn.active_hidden / p.tp,  # MoE: the experts one token passes (top_k + shared)
        keys=sum(_keys_as_run(args, i, seq_len, profile.kind) for i in range(args.n_layers)) / args.n_layers,
    )
    if getattr(
        args, "mla", False
    ):  # QKᵀ over nope + rope channels a head, AV over v_head_dim; MLA's projections
        heads = args.n_heads
        q, v = heads * (args.qk_nope_head_dim + args.qk_rope_head_dim), heads * args.v_head_dim
        shape = dataclasses.replace(shape, q=q / p.tp, v=v / p.tp, proj=mla_projections(args))
    flops = _matmuls(shape)
    rates = [rate] * (len(flops) - 5) + [mlp_rate] * 3 + [hp_rate] * 2  # in _matmuls' order
    attention = cpu_attention(profile, precision)
    if attention is not None:  # SDPA's CPU kernel at its own rate, not the GEMMs'
        rates[-2:] = [attention[1] * share] * 2
    back = list(rates)
    if profile.kind != "cpu":  # attention at its kernel's measured rates (ATTENTION_SHARES)
        peak = profile.peak_flops["bf16"] * share
        forward, backward = ATTENTION_SHARES.get(
            getattr(args, "attention", "auto"), ATTENTION_SHARES["flash"]
        )
        rates[-2:] = [peak * forward] * 2
        # backward's 2.5x forward FLOPs at its measured rate, as the two forward-sized matmuls below count it
        back[-2:] = [peak * backward * 2 / ATTENTION_BACKWARD_FLOPS] * 2
    fwd = sum(t0 + f / r for f, r in zip(flops, rates))
    bwd = sum(2 * (t0 + f / r) for f, r in zip(flops, back))  # two matmuls per forward one: dX and dW
    if attention is not None:  # and its cost per (sequence, head) row, a third in forward as its FLOPs are
        rows = attention[0] * micro * args.n_heads / p.tp * _slowdown(profile, share)
        fwd, bwd = fwd + rows / 3, bwd + 2 * rows / 3
    # On a CPU element-wise work moves fp32's bytes in every precision: autocast leaves the residual stream and the
    # norms in fp32, and a bf16 kernel converts each element (SiLU on 90k bf16 elements: 51 us, fp32 38 us here).
    elt = 4 if profile.kind == "cpu" else compute_bytes_of(precision)
    saved = layer_activation_bytes(args, p, micro, seq_len, elt)
    elementwise = ELEMENTWISE_TRAFFIC * saved / (profile.memory_bw * share)
    overhead = profile.op_overhead_s * _slowdown(profile, share) if profile.kind == "cpu" else 0.0
    # selective_op recomputes every second Linear of the forward (wk, wo, w3; parallel/recompute.py)
    again = sum(t0 + f / r for f, r in zip(flops[1:-2:2], rates[1:-2:2]))
    return {
        "fwd": fwd,
        "bwd": bwd,
        "linears_again": again,
        "elementwise": elementwise + overhead,
        "attention": 3 * (flops[-1] * 2) / rates[-1],
    }


def cpu_attention(profile: DeviceProfile, precision: str) -> tuple[float, float] | None:
    """A CPU's measured SDPA figures (seconds per row, FLOP/s) for `precision`'s attention: bf16's under autocast,
    FSDP2's 16-bit policy and fp8 (attention stays a bf16 kernel there), fp32's where that dtype was not measured;
    None on a GPU or where nothing was measured (the GEMM rate's)."""
    if profile.kind != "cpu":
        return None
    measured = profile.attention
    return measured.get("fp32" if precision == "fp32" else "bf16") or measured.get("fp32")


def split_block_s(profile: DeviceProfile, split: str, hidden: float) -> float:
    """A CPU's fitted cost per block of tensor parallel ("tp"), what sequence parallel adds to it ("sp") or ring
    attention ("cp"), for a micro-batch of `hidden` hidden-state elements on a rank: fixed plus per element."""
    return getattr(profile, f"{split}_block_s") + getattr(profile, f"{split}_element_s") * hidden


def cast_rate(profile: DeviceProfile) -> tuple[float, float]:
    """(seconds per cast call, bytes/s) of a cast to 16 bits: calibrated on a CPU (planning/measure.measure_cast);
    a profile without it (a GPU's, a CPU profile saved before the measurement) casts at its memory bandwidth with
    no fixed cost."""
    return profile.cast_t0_s, profile.cast_bw or profile.memory_bw


def _cast_s(
    args: ModelArgs,
    p: ParallelConfig,
    profile: DeviceProfile,
    micro: int,
    seq_len: int,
    share: float,
    inputs: bool,
) -> tuple[float, float]:
    """Seconds of the casts to and from 16 bits in (one block, the output head) for one micro-batch on one rank:
    under autocast (`inputs`) CAST_BYTES per Linear weight and per element of the inputs it casts. Under FSDP2's
    policy the parameters are gathered in 16 bits (the cast of the shard before each gather is left out, 1/N of
    them) and activations are never fp32: only the weight gradient's cast to fp32 for the reduce, half of it."""
    t0, bw = cast_rate(profile)
    t0, bw = t0 * _slowdown(profile, share), bw * share
    split, _ = block_parameters(args)
    tokens = micro * seq_len / p.cp  # (split leaves out MoE's routed experts: no Linear, autocast skips them)
    weights = 1.0 if inputs else 0.5
    block_bytes = CAST_BYTES * (weights * split / p.tp + inputs * CAST_INPUTS * tokens * args.dim)
    head_bytes = CAST_BYTES * (weights * args.vocab_size * args.dim / p.tp + inputs * tokens * args.dim)
    calls = CAST_CALLS if inputs else 7
    return calls * t0 + block_bytes / bw, (1 + 3 * inputs) * t0 + head_bytes / bw


def _not_fp8(precision: str) -> str:
    """The precision of what fp8 training leaves out of fp8: attention, the embedding and the output head."""
    return "bf16" if precision == "fp8" else precision


def _matmul_rate(profile: DeviceProfile, precision: str) -> tuple[float, float]:
    """(t0, FLOP/s) of the profile's matmuls in `precision` (fp16 as bf16; fp32 where nothing else is known)."""
    m = profile.matmul
    return m.get(precision) or m.get("bf16" if precision == "fp16" else "fp32") or next(iter(m.values()))


def _links(profile: DeviceProfile, dims: Layout, gpus_per_node: int) -> dict[str, Link]:
    """The link each mesh group uses: the mesh is (pp, dp_replicate, dp_shard, cp, tp) with tp innermost, so a
    group of size n and stride s (the product of the dims inside it) stays in one node iff n·s <= gpus_per_node;
    a group that spans nodes runs at the slower (inter-node) link. On a GPU each GPU has its own NIC (DGX/HGX) and
    NCCL spreads its rings' channels over the NICs of every member in a node, so a spanning group with k members
    a node moves k NICs' worth, up to NVLink's rate: 32 H200 over 4 nodes (8 NICs each) measured a 4 GiB
    all-reduce at 364.9 GB/s bus bandwidth, one node's NVLink ring rate (367.2), not one NIC's 50 GB/s (S. Bekman,
    ml-engineering network/README.md at 744d01e, nccl-tests and all_reduce_bench.py, NCCL 2.27.7)."""
    intra = Link(profile.intra_bw, profile.intra_latency)
    inter = Link(profile.inter_bw, profile.inter_latency)

    def link(size: int, stride: int) -> Link:
        if size * stride <= gpus_per_node:
            return intra
        if profile.kind == "cpu":
            return inter
        members = max(1, gpus_per_node // stride)  # the group's members in one node, each with its NIC
        return Link(min(profile.intra_bw, members * profile.inter_bw), profile.inter_latency)

    tp, cp, shard, rep = dims.tp, dims.cp, dims.dp_shard, dims.dp_replicate
    return {
        "tp": link(tp, 1),
        "cp": link(cp, tp),
        "dp_shard_cp": link(shard * cp, tp),
        "dp_replicate": link(rep, shard * cp * tp),
        "dp_cp": link(rep * shard * cp, tp),
        "pp": link(dims.pp, rep * shard * cp * tp),
        "ep": link(getattr(dims, "ep", 1), cp * tp),  # ep is dp_shard's innermost part
    }


def _calibrated(profile: DeviceProfile, op: str, n: int, size: float, link: Link) -> float:
    """A collective's time from the profile's fitted (latency per step, bandwidth) for that op where calibration
    measured one ("op@ranks", the bandwidth in the ring formula's convention), at the measured group size nearest
    to n: on a CPU the figures change with the ranks sharing its cores (more ranks than cores: each ring step waits
    for its peer to be scheduled). Else the link's."""
    formula = {"all_reduce": all_reduce_s, "all_gather": all_gather_s, "reduce_scatter": reduce_scatter_s}[op]
    sizes = [int(k.split("@")[1]) for k in profile.collectives if k.split("@")[0] == op]
    if sizes and n > 1:
        near = min(sizes, key=lambda s: (abs(math.log(s / n)), -s))
        latency, bw = profile.collectives[f"{op}@{near}"]
        link = Link(bw, latency)
    return formula(n, size, link)


def step_time(
    args: ModelArgs,
    parallel: ParallelConfig,
    training: TrainingConfig,
    memory: MemoryConfig,
    seq_len: int,
    world_size: int,
    profile: DeviceProfile,
    *,
    global_batch: int,
    gpus_per_node: int | None = None,
    precision: str = "fp32",
    mechanism: str = "auto",
    optimizer: OptimizerConfig | None = None,
) -> dict[str, float]:
    """Seconds per optimizer step and its breakdown: compute (forward, backward, recompute, element-wise, casts), each
    communication's exposed share, the pipeline bubble, the optimizer and a fixed overhead; with tokens_per_s and
    mfu. `global_batch` in sequences; `precision`, `mechanism`: precision.compute and .mechanism; `optimizer`:
    Muon's cost where its name is muon (AdamW's otherwise, and by default). Raises ConfigError if the layout does not
    tile the world."""
    p, dims = parallel, Layout.resolve(parallel, training, seq_len, world_size).checked()
    node = gpus_per_node or profile.devices_per_node
    # The ranks sharing one machine: on a CPU every rank is a local process on this host's cores.
    procs = world_size if profile.kind == "cpu" else min(world_size, node)
    threads = training.threads or max(1, (profile.cores or 1) // procs)
    share = _cpu_share(profile, procs, threads)
    local = max(global_batch // dims.dp_size, 1)
    v = stages_per_rank(p.pp_schedule, p.pp_virtual_stages) if p.pp > 1 else 1
    if p.pp > 1:
        m = resolve_microbatches(p.pp_microbatches, local, training.micro_batch)
        micro = max(local // m, 1)
    else:
        micro = min(training.micro_batch, local)
        m = max(local // micro, 1)
    layers = args.n_layers / p.pp  # per rank (its v stages together)
    b = _block_times(args, p, profile, precision, micro, seq_len, share)
    b["cast"], b["head_cast"], b["cast_again"] = 0.0, 0.0, 0.0
    if precision != "fp32":  # autocast's casts, or FSDP2's policy's (precision/policy.resolve_precision)
        inputs = mechanism == "autocast" or (mechanism == "auto" and not dims.fsdp)
        b["cast"], b["head_cast"] = _cast_s(args, p, profile, micro, seq_len, share, inputs)
        b["cast_again"] = b["cast"] / 2 if inputs else 0.0  # recompute re-runs autocast's forward casts
    links = _links(profile, dims, node)
    out = _compute_parts(args, p, precision, memory, profile, b, m, micro, seq_len, layers, share)
    slow = _slowdown(profile, share)
    comm = _comm_parts(
        args, p, dims, profile, links, b, out, m, micro, seq_len, layers, precision, memory, slow
    )
    out.update(comm)
    busy = out["compute_s"] + out["tp_comm_s"] + out["cp_comm_s"] + out["ep_comm_s"] + out["pp_p2p_s"]
    out["bubble_s"] = _exposed_bubble(profile, pipeline_bubble(p.pp_schedule, p.pp, m, v), slow) * busy
    n_local = _local_params(args, p, dims)
    out["optimizer_s"] = n_local * ADAM_TRAFFIC / ((profile.optimizer_bw or profile.memory_bw) * share)
    out["overhead_s"] = profile.step_overhead_s * _slowdown(profile, share) if profile.kind == "cpu" else 0
    out["muon_s"] = 0.0
    if optimizer is not None and optimizer.name == "muon":
        out.update(_muon(args, dims, profile, links, share, slow, optimizer.muon_ns_steps))
    keys = ("compute_s", "tp_comm_s", "cp_comm_s", "ep_comm_s", "pp_p2p_s", "dp_comm_exposed_s", "bubble_s",
            "optimizer_s", "muon_s")  # fmt: skip
    out["step_time_s"] = sum(out[k] for k in keys) + out["overhead_s"]
    tokens = global_batch * seq_len
    out["tokens_per_s"] = tokens / out["step_time_s"]
    n_params = _non_embedding_params(args)
    out["flops_per_token"] = model_flops_per_token(n_params, args, seq_len)
    peak = _peak(profile, precision, share)
    out["mfu"] = out["tokens_per_s"] * out["flops_per_token"] / (peak * world_size)
    out.update(micro_batch=micro, microbatches=m)
    return out


def _muon(
    args: ModelArgs, dims: Layout, profile: DeviceProfile, links: dict, share: float, slow: float, steps: int
) -> dict[str, float]:
    """muon_step_s on this device: Newton-Schulz at the fp32 matmul rate of the rank's cores, the exchange on the
    data-parallel group's link (calibrated where the profile measured the group size)."""
    n = muon_ranks(dims)
    link = links["dp_cp" if dims.parallel.data_parallel in ("ddp", "zero1") else "dp_shard_cp"]
    t0, rate = _matmul_rate(profile, "fp32")
    exchange = lambda ranks, size: _calibrated(profile, "all_gather", ranks, size, link)  # noqa: E731
    return muon_step_s(args, dims, steps, (t0 * slow, rate * share), exchange, _call_s(profile, n, slow))


def _peak(profile: DeviceProfile, precision: str, share: float) -> float:
    """The per-rank peak MFU divides by, in the precision train.py reports it against (mfu_precision: fp8 against
    the bf16 peak): the datasheet's for a GPU; on a CPU the measured matmul rate of the cores the rank gets."""
    name = mfu_precision(precision, "cpu" if profile.kind == "cpu" else "cuda")
    if profile.kind != "cpu":
        return profile.peak_flops.get(name) or profile.peak_flops["bf16"]
    return (profile.peak_flops.get(name) or profile.peak_flops["fp32"]) * share


def _non_embedding_params(args: ModelArgs) -> int:
    """The N of 6N: under MoE the active parameters (a token's top_k routed experts, not all of them)."""
    split, rep = block_parameters(args)
    ffn = ffn_shape(args)
    active_routed = ffn.routed * getattr(args, "top_k", 0) / max(getattr(args, "n_experts", 0), 1)
    out = 0 if args.tie_embeddings else args.vocab_size * args.dim
    return int(args.n_layers * (split + rep + active_routed) + args.dim + out)


def _local_params(args: ModelArgs, p: ParallelConfig, dims: Layout) -> float:
    """Parameters one rank's optimizer steps: its pipeline share, split by tp, sharded by ZeRO-1 and above."""
    split, rep = block_parameters(args)
    tables = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2) / p.pp
    n = (args.n_layers / p.pp) * (split / p.tp + rep) + tables / p.tp
    ep = getattr(p, "ep", 1)
    experts = (args.n_layers / p.pp) * ffn_shape(args).routed / ep
    if p.data_parallel == "ddp":
        return n + experts
    shards = dims.dp_shard * dims.cp if p.data_parallel == "hsdp" else dims.dp_size * dims.cp
    return n / shards + experts / max(shards // ep, 1)


def recompute_share(memory: MemoryConfig) -> float:
    """Extra block forwards per block that recompute runs in backward: full 1, every_k 1/k, else 0 (selective
    re-runs only element-wise ops, counted apart)."""
    k = max(memory.recompute_every, 1)
    return {"full": 1.0, "every_k": 1.0 / k}.get(memory.recompute, 0.0)


def _compute_parts(
    args: ModelArgs,
    p: ParallelConfig,
    precision: str,
    memory: MemoryConfig,
    profile: DeviceProfile,
    b: dict[str, float],
    m: int,
    micro: int,
    seq_len: int,
    layers: float,
    share: float,
) -> dict[str, float]:
    """Forward, backward and recompute seconds of one rank's step: m micro-batches through its layers, plus the
    output head on the last stage (counted on every rank: the pipeline's slowest stage sets the pace)."""
    policy, extra = memory.recompute, recompute_share(memory)
    ew_fwd = b["elementwise"] / 3  # forward's share of the element-wise work
    recompute = extra * (b["fwd"] + ew_fwd + b["cast_again"])
    # A CPU's calibration measures the share selective re-runs and its dispatch mode's cost.
    if policy in ("selective", "selective_op"):
        fixed = profile.selective_block_s * _slowdown(profile, share) if profile.kind == "cpu" else 0.0
        recompute += (profile.selective_share or SELECTIVE_SHARE) * ew_fwd + fixed
        recompute += b["linears_again"] if policy == "selective_op" else 0.0
    t0, rate = _matmul_rate(profile, _not_fp8(precision))
    head_flops = 2 * micro * seq_len / p.cp * args.dim * args.vocab_size / p.tp
    head = 3 * (t0 * _slowdown(profile, share) + head_flops / (rate * share))  # forward, dX, dW
    per_micro = layers * (b["fwd"] + b["bwd"] + b["elementwise"] + b["cast"]) + head + b["head_cast"]
    return {
        "forward_s": m * layers * b["fwd"],
        "backward_s": m * layers * b["bwd"],
        "elementwise_s": m * layers * b["elementwise"],
        "recompute_s": m * layers * recompute,
        "head_s": m * head,
        "cast_s": m * (layers * b["cast"] + b["head_cast"]),
        "compute_s": m * (per_micro + layers * recompute),
    }


def _comm_parts(
    args: ModelArgs,
    p: ParallelConfig,
    dims: Layout,
    profile: DeviceProfile,
    links: dict[str, Link],
    b: dict[str, float],
    compute: dict[str, float],
    m: int,
    micro: int,
    seq_len: int,
    layers: float,
    precision: str,
    memory: MemoryConfig,
    slow: float,
) -> dict[str, float]:
    """Each parallelism's communication per step and the share of it on the critical path. On a CPU each call
    also costs a calibrated fixed time (`_call_s`), and tp, sp and cp a fitted cost per block (`split_block_s`)."""
    elt = compute_bytes_of(precision)
    gpu = profile.kind != "cpu"  # gloo on a few shared CPU cores overlaps nothing: all of it is exposed
    act = micro * seq_len / p.cp * args.dim * elt  # one micro-batch's hidden states on this rank
    out: dict[str, float] = {}
    # TP (Megatron): per block two all-reduces in forward and two in backward (SP: an all-gather and a
    # reduce-scatter in place of each, a ring all-reduce's two halves: the same bytes); full recompute repeats the
    # forward's. On the critical path.
    tp_per_block = 4 + 2 * recompute_share(memory)
    if p.sequence_parallel:
        one = all_gather_s(dims.tp, act, links["tp"]) + reduce_scatter_s(dims.tp, act, links["tp"])
    else:
        one = all_reduce_s(dims.tp, act, links["tp"])
    again = 1 + recompute_share(memory) / 3  # full recompute repeats the forward's third of the dispatch
    hidden = micro * seq_len / p.cp * args.dim  # its elements, which the fitted per-block costs grow with
    tp_fixed = 0.0
    if not gpu and dims.tp > 1:
        sp = split_block_s(profile, "sp", hidden) if p.sequence_parallel else 0.0
        tp_fixed = (split_block_s(profile, "tp", hidden) + sp) * slow * again
    out["tp_comm_s"] = m * layers * (tp_per_block * (one + _call_s(profile, dims.tp, slow)) + tp_fixed)
    # CP ring attention: cp-1 exchanges of a K/V chunk per block in forward, K/V and their gradients in backward;
    # each step overlaps the attention of the chunk in hand on a GPU.
    kv = micro * seq_len / p.cp * 2 * args.n_kv_heads * args.head_dim / p.tp * elt
    ring = 0.0
    if dims.cp > 1:
        step_comm = 3 * p2p_s(kv, links["cp"])  # forward K/V, backward K/V and dK/dV
        step_attn = b["attention"] / dims.cp
        if gpu:
            ring = (dims.cp - 1) * max(0.0, step_comm - step_attn)
        else:
            call = _call_s(profile, dims.cp, slow)
            ring = (dims.cp - 1) * (step_comm + 3 * call) + split_block_s(profile, "cp", hidden) * slow
        # Full and every_k recompute re-run the ring's forward (its K/V exchange); selective keeps the ring op's
        # output (parallel/recompute.py), so it repeats none of it.
        ring *= 1 + recompute_share(memory) / 3
    out["cp_comm_s"] = m * layers * ring
    # PP: each micro-batch's hidden states forward and their gradient back at every stage boundary of this rank;
    # on a GPU the sends overlap the next micro-batch except in the warm-up and cool-down.
    v = stages_per_rank(p.pp_schedule, p.pp_virtual_stages) if p.pp > 1 else 1
    hop = p2p_s(act, links["pp"]) if p.pp > 1 else 0.0
    out["pp_p2p_s"] = 2 * (hop + _call_s(profile, p.pp, slow)) * ((p.pp - 1) * v if gpu else m * v)
    # EP: each MoE layer's dispatch and combine all-to-all in forward, their gradients in backward (full
    # recompute repeats the forward's); on the critical path (the experts wait for their tokens).
    ep, share = getattr(p, "ep", 1), ffn_shape(args).moe_share
    out["ep_comm_s"] = 0.0
    if ep > 1 and share:
        one = all_to_all_s(ep, dispatch_bytes(args, micro * seq_len / p.cp, elt), links["ep"])
        one += _call_s(profile, ep, slow)
        out["ep_comm_s"] = m * layers * share * 2 * (2 + recompute_share(memory)) * one
    out.update(_dp_comm(args, p, dims, profile, links, compute, layers, elt, m, slow))
    return out


def _dp_comm(
    args: ModelArgs,
    p: ParallelConfig,
    dims: Layout,
    profile: DeviceProfile,
    links: dict[str, Link],
    compute: dict[str, float],
    layers: float,
    elt: int,
    m: int,
    slow: float,
) -> dict[str, float]:
    """Data-parallel traffic per step (fp32 gradients reduced, parameters gathered in the compute dtype) and its
    exposed share. DDP all-reduces bucket by bucket during the last backward (exposed: the last bucket and what
    outlasts that backward); zero1 adds the broadcast of updated shards; FSDP/zero2 gather each block before use
    and reduce-scatter after its backward, overlapping all but the first gather and the last reduce-scatter."""
    n, gpu = dims.dp_size * dims.cp, profile.kind != "cpu"
    if n <= 1:
        return {"dp_comm_s": 0.0, "dp_comm_exposed_s": 0.0}
    split, rep = block_parameters(args)
    block = split / p.tp + rep + ffn_shape(args).routed / getattr(p, "ep", 1)
    tables = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2) / p.pp / p.tp
    local = layers * block + tables  # parameters of this rank before ZeRO sharding
    mode, link = p.data_parallel, links["dp_cp"]
    backward_last = compute["compute_s"] / m * 2 / 3  # the last micro-batch's backward, where DDP overlaps
    if mode in ("ddp", "zero1"):
        total = _calibrated(profile, "all_reduce", n, local * 4, link)
        bucket = _calibrated(profile, "all_reduce", n, min(p.ddp_bucket_mb * 2**20, local * 4), link)
        calls = math.ceil(local * 4 / (p.ddp_bucket_mb * 2**20)) + (mode == "zero1")
        total += calls * _call_s(profile, n, slow)
        exposed = bucket + max(0.0, total - bucket - backward_last) if gpu else total
        if mode == "zero1":  # ZeroRedundancyOptimizer broadcasts each rank's updated shard: an all-gather
            gather = _calibrated(profile, "all_gather", n, local * 4, link)
            total, exposed = total + gather, exposed + gather
        return {"dp_comm_s": total, "dp_comm_exposed_s": exposed}
    shard_n = dims.dp_shard * dims.cp if mode == "hsdp" else n
    shard_link = links["dp_shard_cp"] if mode == "hsdp" else link
    gathers = (
        1 if mode == "zero2" else 2 * m
    )  # zero2 keeps the gathered weights to backward, across micro-batches
    reduces = m if p.grad_sync == "micro_batch" else 1
    ag = _calibrated(profile, "all_gather", shard_n, block * elt, shard_link)
    rs = _calibrated(profile, "reduce_scatter", shard_n, block * 4, shard_link)
    tables_t = _calibrated(profile, "all_gather", shard_n, tables * elt, shard_link) * min(gathers, 2)
    tables_t += _calibrated(profile, "reduce_scatter", shard_n, tables * 4, shard_link) * reduces
    total = layers * (gathers * ag + reduces * rs) + tables_t
    if mode == "hsdp" and dims.dp_replicate > 1:  # the shard's gradients all-reduced across replicas
        total += _calibrated(
            profile, "all_reduce", dims.dp_replicate, local * 4 / shard_n, links["dp_replicate"]
        )
    if not gpu:
        calls = layers * (gathers + reduces) + min(gathers, 2) + reduces
        total += _call_s(profile, shard_n, slow) * calls
        return {"dp_comm_s": total, "dp_comm_exposed_s": total}
    hidden = max(0.0, total - ag - rs - tables_t)
    exposed = ag + rs + tables_t + max(0.0, hidden - compute["compute_s"])
    return {"dp_comm_s": total, "dp_comm_exposed_s": exposed}
