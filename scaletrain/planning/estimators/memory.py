"""The memory one rank needs for a model, layout and batch: the estimate `validate` uses to refuse a run that
cannot fit, with the knob that would make it fit, and the planner's memory model (per_rank_bytes, by part)."""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from scaletrain.config import Config, MemoryConfig, ParallelConfig, TrainingConfig
from scaletrain.data.loader import tokenizer_vocab
from scaletrain.data.prepare import resolve_cache_dir
from scaletrain.errors import ConfigError
from scaletrain.hardware import CPU_OVERHEAD_BYTES, host_memory_bytes, uses_cuda
from scaletrain.models.attention import max_logits_bytes
from scaletrain.models.init import WHOLE_PARAM_COPIES
from scaletrain.models.llama import ModelArgs
from scaletrain.models.loss import loss_activation_bytes
from scaletrain.models.presets import resolve_model_args
from scaletrain.optim.optimizers import adamw_implementation
from scaletrain.parallel.layout import Layout, resolve_microbatches
from scaletrain.parallel.pipeline import (
    layers_per_stage,
    placement_style,
    rank_stages,
    reshards_after_forward,
    stages_per_rank,
)
from scaletrain.planning.estimators.hardware import UNCALIBRATED, load_profile
from scaletrain.planning.estimators.moe import ffn_shape
from scaletrain.precision.policy import cast_mechanism

GiB = 2**30
# CUDA context (~0.5 GiB), NCCL buffers and caching-allocator fragmentation: what a GPU rank loses before the
# model's first byte. A CPU process pays much less (hardware.CPU_OVERHEAD_BYTES). (The planner takes this constant
# from the device profile; calibration measures it on a CPU.)
GPU_OVERHEAD_BYTES = 2 * GiB
# The memory check's stated error on a CPU host: a layout whose estimate is within it of the host share is refused.
# The worst case of benchmarks/memory_matrix.py measured below its estimate by at most this (docs/planner.md).
CPU_ESTIMATE_ERROR = 0.10
# What FSDP2 keeps in a CPU process's heap per block it wraps, beyond the tensors: its parameter groups, hooks and
# the DTensor metadata of each parameter; and tensor parallel per block it splits (DTensor parameters, the plan's
# hooks, sharding propagation's caches). Measured through the CLI on 2 gloo ranks, a dim-64 model of 2 and 32
# blocks: fsdp 0.46 MiB a block, zero2 0.55, tp 2 0.61 (ddp 0.10, not counted), torch 2.13.0+cpu (issue 35), with
# foreach AdamW, whose per-tensor sqrt(v) of a tp block's small shards stayed in the heap: with the fused kernel
# the same bare loop (test_block_host_memory) holds 0.29 MiB a tp block against 0.37, so tp's is 0.08 less. A GPU
# rank keeps them in host memory, not the device's.
FSDP_UNIT_HOST_BYTES = int(0.55 * 2**20)
TP_BLOCK_HOST_BYTES = int(0.53 * 2**20)


def block_host_bytes(sharded: bool, tp: int) -> int:
    """A CPU process's heap bytes per block beyond its tensors: FSDP2's where it shards, tp's where it splits."""
    return FSDP_UNIT_HOST_BYTES * sharded + TP_BLOCK_HOST_BYTES * (tp > 1)


# The data-parallel modes FSDP2 runs (zero2: not resharded after forward).
FSDP_MODES = ("fsdp", "hsdp", "zero2")
# fp32 AdamW (Rajbhandari et al. 2020, ZeRO): parameters 4 bytes, gradients 4, the moments m and v 8. Our bf16 and
# fp16 keep exactly these (fp32 master weights, fp32 gradients after the reduce, fp32 moments): the 16-bit copies
# are transients (autocast's weight cache, FSDP2's gathered parameters), counted in "gathered".
PARAM_BYTES, GRAD_BYTES, ADAM_BYTES = 4, 4, 8
# The ZeRO paper's mixed-precision Adam: fp16 parameters 2, fp16 gradients 2, and K = 12 bytes of fp32 master
# weights, m and v: also 16 bytes per parameter in all, split differently (see model_state_bytes).
ZERO_PAPER_BYTES = (2, 2, 12)
PARTS = (
    "parameters",
    "gradients",
    "optimizer",
    "gathered",
    "activations",
    "logits",
    "buckets",
    "grad_copy",
    "step",
    "overhead",
    "not_at_once",
)


def model_state_bytes(
    n: float, stage: int, shards: int, per_param: tuple[int, int, int] = (PARAM_BYTES, GRAD_BYTES, ADAM_BYTES)
) -> dict[str, float]:
    """Parameters, gradients and optimizer state of `n` parameters on one of `shards` data-parallel ranks at ZeRO
    stage 0 (replicated), 1 (P_os), 2 (P_os+g) or 3 (P_os+g+p), with `per_param` bytes of each (Rajbhandari et al.
    2020, figure 1: (2 + 2 + K)·Ψ at stage 0, 2Ψ + 2Ψ + KΨ/N_d at 1, 2Ψ + (2 + K)Ψ/N_d at 2, (2 + 2 + K)Ψ/N_d at 3)."""
    p, g, o = per_param
    return {
        "parameters": n * p / (shards if stage >= 3 else 1),
        "gradients": n * g / (shards if stage >= 2 else 1),
        "optimizer": n * o / (shards if stage >= 1 else 1),
    }


def compute_bytes_of(precision: str) -> int:
    """Bytes of one activation element and of one gathered/cast parameter: 2 under bf16 or fp16 (autocast or FSDP2's
    MixedPrecisionPolicy param_dtype) and fp8 (its blocks run in bf16 around fp8 matmuls, and torchao keeps the
    bf16 inputs for backward), else 4."""
    return 2 if precision in ("bf16", "fp16", "fp8") else 4


def block_parameters(args: ModelArgs) -> tuple[int, int]:
    """(split by tp, replicated) parameters of one transformer block: the matrices of attention and SwiGLU are
    split by tensor parallel, the two RMSNorm weights are replicated. Under MoE, the average block's dense part
    (shared experts and router included); its routed experts are `ffn_shape(args).routed`, split by ep."""
    attention, norms = attention_parameters(args)
    return attention + ffn_shape(args).dense, 2 * args.dim + norms


def attention_parameters(args: ModelArgs) -> tuple[int, int]:
    """(matrices, RMSNorm weights) of one block's attention: grouped-query attention's wq, wk, wv, wo; or multi-head
    latent attention's (models/mla.py): the query latent's two projections (or wq), wkv_a to the kv latent and the
    shared rotary key, wkv_b to each head's key and value, wo, and the latents' norms."""
    if not getattr(args, "mla", False):
        kv = args.n_kv_heads * args.head_dim
        return 2 * args.dim * args.n_heads * args.head_dim + 2 * args.dim * kv, 0
    heads, qk = args.n_heads, args.qk_nope_head_dim + args.qk_rope_head_dim
    r_q, r_kv = args.q_lora_rank, args.kv_lora_rank
    q = (args.dim + heads * qk) * r_q if r_q else args.dim * heads * qk
    kv = args.dim * (r_kv + args.qk_rope_head_dim) + r_kv * heads * (args.qk_nope_head_dim + args.v_head_dim)
    return q + kv + heads * args.v_head_dim * args.dim, r_q + r_kv


def attention_saved(args: ModelArgs) -> float:
    """Elements per token that one block's attention saves for backward besides its input, split by tp: GQA's q
    and output (2h) and k, v (2kv); MLA's q and k (heads x (nope + rope) each), v and output (heads x v_head_dim
    each), and its latents: the query latent before and after its norm, wkv_a's output and the normed kv latent
    (derived from models/mla.py, not measured; tensor parallel is refused for MLA)."""
    if not getattr(args, "mla", False):
        return 2 * args.dim + 2 * args.n_kv_heads * args.head_dim
    heads, qk, v = args.n_heads, args.qk_nope_head_dim + args.qk_rope_head_dim, args.v_head_dim
    latents = 2 * args.q_lora_rank + 2 * args.kv_lora_rank + args.qk_rope_head_dim
    return 2 * heads * qk + 2 * heads * v + latents


def init_draw_bytes(args: ModelArgs) -> float:
    """The most memory drawing one parameter whole takes: sharded initialisation draws every parameter whole, one
    at a time, on every rank whatever its share (parallel/materialize.py). trunc_normal_ (the matrices, an untied
    output, under MoE one block's stacked routed experts, all E of them even under ep) holds WHOLE_PARAM_COPIES of
    it; normal_ (the embedding) one."""
    trunc = [args.dim * args.ffn_hidden, args.dim * args.n_heads * args.head_dim]
    trunc += [] if args.tie_embeddings else [args.vocab_size * args.dim]
    if args.n_experts:
        hidden = args.moe_hidden or args.ffn_hidden
        trunc += [args.n_experts * hidden * args.dim, hidden * args.shared_experts * args.dim]
    return PARAM_BYTES * max(args.vocab_size * args.dim, WHOLE_PARAM_COPIES * max(trunc))


def init_peak_bytes(part: dict[str, float], draw: float, ddp_like: bool, shards: int = 1) -> float:
    """A rank's peak while it materialises its model (parallel/materialize.py), before step 1: its share of the
    parameters on the device (`shards`: zero2's FSDP2 holds 1/shards of what its step gathers, "parameters"),
    DDP's gradient buckets (allocated when it wraps; on a CPU not resident until the first backward writes them),
    one parameter drawn whole (init_draw_bytes) and the constant overhead. Under optimizer offload the share lives
    on the host and only the drawn parameter on the device. Held against the kernel's figure in
    tests/distributed/test_init_peak.py."""
    buckets = part["gradients"] if ddp_like else 0.0
    return part["parameters"] / shards + buckets + draw + part["overhead"]


def _zero_shards(p: ParallelConfig, dims: Layout) -> int:
    """Ranks the sharded state is spread over: every data-parallel and context-parallel rank (context-parallel
    ranks hold the same parameters and sum their gradients); hsdp shards within dp_shard x cp only."""
    if p.data_parallel == "ddp":
        return 1
    return dims.dp_shard * dims.cp if p.data_parallel == "hsdp" else dims.dp_size * dims.cp


def _in_flight(p: ParallelConfig, pp_rank: int, n_micro: int, v: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak. GPipe: all of them; 1F1B: pp - rank
    (Narayanan et al. 2021); interleaved: that times 1 + (p-1)/(p·v) (Korthikanti et al. 2022, §4.2.3); the V
    schedules balance it to p + 1 on every rank (DeepSeek-V3 report 2024, table 2)."""
    pp = p.pp
    if pp == 1:
        return 1
    if p.pp_schedule == "gpipe":
        return n_micro
    if p.pp_schedule == "1f1b":
        return min(n_micro, pp - pp_rank)
    if p.pp_schedule in ("zbv", "dualpipev"):
        return min(n_micro, pp + 1)
    return min(n_micro, (pp - pp_rank) * (1 + (pp - 1) / (pp * v)))


def layer_activation_bytes(
    args: ModelArgs,
    p: ParallelConfig,
    micro: int,
    seq_len: int,
    elt: int,
    recompute: str = "none",
    mechanism: str | None = None,
    compiled: bool = False,
) -> float:
    """Bytes one block keeps for backward per micro-batch under a recompute policy: the tensors autograd saves in
    our Llama block, derived in docs/memory.md and measured there within 0.1% (s·b elements of each, s = seq_len /
    cp; h dim, kv = n_kv_heads·head_dim, f ffn_hidden, a heads; `elt` bytes per element).
    - none: 8h + 2kv + 4f + a + 2. The norms' inputs and x̂ (4h) and their rsqrt (2) are split by tp only under
      sequence parallel; the matmul inputs wq/wk/wv and w1/w3 see (2h) are whole under tp, gathered under SP; q, k,
      v, the attention output and its logsumexp, and SwiGLU's four f-sized tensors are split by tp. No a·s² term:
      fused SDPA never stores the scores (Korthikanti et al. 2022 count 34·sbh + 5·a·s²·b for GPT with dropout).
    - selective: 5h + 2kv + 2f + a (the matmul and SDPA outputs, and the block input).
    - selective_op: 4h + kv + f + a, selective less the outputs of wk, wo and w3 (every second Linear).
    - full: h (the block input). every_k: the mean of full and none over the layers it recomputes (1 in k).
    With `mechanism`, precision's cast mechanism (precision/policy.py), 16-bit compute keeps more than `elt` bytes
    of some (measured per tensor, test_a_block_saves_what_the_formula_says_under_each_cast_mechanism): RMSNorm
    normalises in fp32, so each norm keeps an fp32 input or copy (4h bytes) and an fp32 rsqrt (4); under autocast
    the residual stream stays fp32 (the embedding's output is never cast), so the block input and x-hat are fp32
    too, and each Linear casts its own copy of its input: wq, wk and wv three, w1 and w3 two (MLA: wq's and wkv_a's
    two). None: every element in `elt` (the time model's traffic).
    `compiled` (training.compile: each block torch.compile'd): under selective and selective_op the compiled block
    keeps h a token less, in fp32, autocast and FSDP2's policy alike (its partitioner recomputes a residual sum the
    eager block keeps; test_a_compiled_block_keeps_h_a_token_less_under_selective_recompute). Without recompute it
    keeps much less (2h + f in fp32, more in 16-bit), not modelled: the eager figure is charged, an over-estimate;
    under full recompute the same."""
    s = seq_len / p.cp * micro  # tokens of one micro-batch on this rank
    ffn = ffn_shape(
        args
    )  # MoE: the experts a token passes, and the dispatched copies (2 x top_k x h) it adds
    h, f, a, tp = args.dim, ffn.active_hidden, args.n_heads, p.tp
    s_moe = ffn.moe_share * 2 * getattr(args, "top_k", 0) * h * (recompute != "full")
    sp = tp if p.sequence_parallel else 1  # what sequence parallel splits
    if recompute == "full":
        per_token = h / sp
    elif recompute == "selective":
        per_token = (3 - int(compiled)) * h / sp + (attention_saved(args) + 2 * f + a) / tp
    elif recompute == "selective_op":
        kv = args.n_kv_heads * args.head_dim
        per_token = (2 - int(compiled)) * h / sp + (attention_saved(args) - kv + f + a) / tp
    else:
        per_token = (4 * h + 2) / sp + 2 * h + (attention_saved(args) + a + 4 * f) / tp
    cast = _cast_bytes(args, elt, mechanism, recompute, sp) if mechanism and elt < 4 else 0.0
    # GPT-OSS's sink attention (models/attention.sink_attention) is no fused kernel: it keeps the fp32 scores
    # with the sink column and their softmax, 8 bytes per query, head and key, and k and v repeated to every
    # head (derived, not measured). Recompute full stores none of it.
    sinks = 0.0
    if getattr(args, "attention_sinks", False) and recompute != "full":
        sinks = s * a / tp * (8 * seq_len + 2 * args.head_dim * elt)
    return s * ((per_token + s_moe) * elt + cast) + sinks


def head_activation_bytes(
    args: ModelArgs, p: ParallelConfig, micro: int, seq_len: int, elt: int, mechanism: str | None = None
) -> float:
    """What the last stage keeps for backward outside its blocks, one micro-batch: the final norm's input, x-hat
    and rsqrt (2h + 1; under 16-bit compute an fp32 copy and rsqrt and x-hat in the residual stream's dtype, as
    a block's norm: _cast_bytes) and its output, which the loss reads (h; autocast casts a copy for the output
    Linear). Split by sequence parallel. memory_matrix --activations, fsdp in bf16 at 2048 tokens of dim 512: 8
    MiB the blocks' formula left out."""
    s, h = seq_len / p.cp * micro, args.dim
    sp = p.tp if p.sequence_parallel else 1
    if mechanism and elt < 4:
        norm = 4 * h + 4 + (4 if mechanism == "autocast" else elt) * h
    else:
        norm = (2 * h + 1) * elt
    return s * ((norm + h * elt) / sp + (h * elt if mechanism == "autocast" and elt < 4 else 0))


def _cast_bytes(args: ModelArgs, elt: int, mechanism: str, recompute: str, sp: int) -> float:
    """Bytes per token a block keeps beyond `elt` per element under 16-bit `mechanism` (layer_activation_bytes):
    the block input in fp32 under autocast (every policy keeps it); without recompute, each norm's fp32 input or
    copy, rsqrt and x-hat in the residual stream's dtype, where the formula charged h + h + 1 at `elt`, and
    autocast's extra per-Linear input copies. The norms' part is split by sequence parallel, the copies are not
    (they are of the gathered input; tp with autocast is not measured)."""
    h, autocast = args.dim, mechanism == "autocast"
    residual = 4 if autocast else elt
    if recompute != "none":
        return (residual - elt) * h / sp
    norms = 2 * (4 * h + 4 + residual * h) - 2 * (2 * h + 1) * elt
    readers = ((2 if getattr(args, "mla", False) else 3) + 2) if autocast else 2  # Linears reading a norm
    return norms / sp + (readers - 2) * elt * h


def activation_bytes(
    args: ModelArgs,
    p: ParallelConfig,
    micro: int,
    seq_len: int,
    elt: int,
    recompute: str,
    every: int,
    mechanism: str | None = None,
    compiled: bool = False,
) -> tuple[float, float]:
    """(bytes per layer and micro-batch in flight, averaged over the layers; the transient of the one block being
    recomputed in backward: its whole activations, once per rank)."""
    none = layer_activation_bytes(args, p, micro, seq_len, elt, mechanism=mechanism)
    if recompute == "none":
        return none, 0.0
    if recompute == "every_k":
        full = layer_activation_bytes(args, p, micro, seq_len, elt, "full", mechanism)
        return full / every + none * (1 - 1 / every), none
    return layer_activation_bytes(args, p, micro, seq_len, elt, recompute, mechanism, compiled), none


def per_rank_bytes(
    args: ModelArgs,
    parallel: ParallelConfig,
    training: TrainingConfig,
    seq_len: int,
    world_size: int,
    *,
    local_batch: int | None = None,
    overhead_bytes: int = GPU_OVERHEAD_BYTES,
    memory: MemoryConfig | None = None,
    precision: str = "fp32",
    qk_clip: bool = False,
    foreach_step: bool = False,
    gloo: bool = False,
) -> dict[str, float]:
    """Bytes on the fullest rank, by part (PARTS) and "total"; with optimizer offload, "host" holds what moved to
    host memory (not in the total). `local_batch`: sequences per data-parallel rank per step (sets the pipeline
    micro-batches; None: pp of training.micro_batch each); `precision`: precision.compute; `qk_clip`:
    optimizer.qk_clip is on (its forwards measure the logits); `foreach_step`: AdamW runs its foreach kernels
    (optimizer.implementation = "foreach", see step_transient_bytes); `gloo`: a CPU's job, its collectives on gloo (their
    reduce-scatter copies, root_unit_bytes; and freed memory back to the kernel at once, _blocks_and_loss). Raises
    ConfigError if the sizes do not tile `world_size`, ValueError
    if the layers cannot fill the pipeline stages."""
    ranks = pp_rank_bytes(
        args, parallel, training, seq_len, world_size,
        local_batch=local_batch, overhead_bytes=overhead_bytes, memory=memory, precision=precision, qk_clip=qk_clip,
        foreach_step=foreach_step, gloo=gloo,
    )  # fmt: skip
    return max(ranks, key=lambda e: e["total"])


def pp_rank_bytes(
    args: ModelArgs,
    parallel: ParallelConfig,
    training: TrainingConfig,
    seq_len: int,
    world_size: int,
    *,
    local_batch: int | None = None,
    overhead_bytes: int = GPU_OVERHEAD_BYTES,
    memory: MemoryConfig | None = None,
    activation_slack: float = 0.0,
    precision: str = "fp32",
    qk_clip: bool = False,
    foreach_step: bool = False,
    gloo: bool = False,
) -> list[dict[str, float]]:
    """per_rank_bytes of every pipeline rank, in pp-rank order (one entry without a pipeline)."""
    p, mem = parallel, memory or MemoryConfig()
    dims = Layout.resolve(parallel, training, seq_len, world_size).checked()
    v = stages_per_rank(p.pp_schedule, p.pp_virtual_stages) if p.pp > 1 else 1
    n_micro = resolve_microbatches(
        p.pp_microbatches, local_batch or p.pp * training.micro_batch, training.micro_batch
    )
    micro = math.ceil(local_batch / n_micro) if p.pp > 1 and local_batch else training.micro_batch
    counts = layers_per_stage(args.n_layers, p.pp * v)
    block_split, block_rep = block_parameters(args)
    routed, ep = ffn_shape(args).routed, getattr(p, "ep", 1)
    vocab_rows = args.vocab_size * args.dim
    shards, elt = _zero_shards(p, dims), compute_bytes_of(precision)
    # fsdp/hsdp under a zero-bubble schedule keep the stage's weights gathered, as zero2 does.
    keeps = not reshards_after_forward(p.data_parallel, p.pp, p.pp_schedule)
    mode = "zero2" if keeps and p.data_parallel in ("fsdp", "hsdp") else p.data_parallel
    out = []
    for r in range(p.pp):
        stages = rank_stages(r, p.pp, v, placement_style(p.pp_schedule)) if p.pp > 1 else [0]
        first, last = 0 in stages, p.pp * v - 1 in stages
        layers = sum(counts[s] for s in stages)
        # tp splits the embedding by vocabulary rows and the output by vocabulary columns; a tied table is one.
        tables = first + (last and not (args.tie_embeddings and first))
        n = (layers * block_split + tables * vocab_rows) / p.tp + layers * block_rep + last * args.dim
        part = _state_bytes(mode, n, shards, (block_split / p.tp + block_rep), elt)
        sharded = mode in FSDP_MODES and shards > 1
        if sharded:  # the root unit, under every FSDP2 mode
            part["gathered"] += root_unit_bytes(args, tables, last, p.tp, elt, mode == "zero2", gloo)
        if routed:  # MoE: this rank's experts, sharded by ZeRO over the ranks that hold the same ones
            experts = _state_bytes(mode, layers * routed / ep, max(shards // ep, 1), routed / ep, elt)
            part = {k: part[k] + experts[k] for k in part}
            n += layers * routed / ep
        accumulating = (local_batch or training.micro_batch) > training.micro_batch
        if sharded:
            units = (block_split / p.tp, (tables * vocab_rows + last * args.dim * p.tp) / p.tp, shards)
            _whole_until_last_microbatch(part, p, mode, n, n_micro, accumulating, elt, units, gloo)
        # Activations kept in the cast mechanism's dtypes; the loss's logits (split by vocabulary under tp).
        in_flight = layers * _in_flight(p, r, n_micro, v)
        cast = cast_mechanism(precision, "auto", dims.fsdp)
        part["activations"], part["logits"], transient = _blocks_and_loss(
            args, p, mem, micro, seq_len, elt, cast, in_flight, last, gloo, training.compile
        )
        # QK-clip: its forwards measure the logits, one chunk of a layer's scores at a time (at the peak too).
        if qk_clip and layers:
            part["activations"] += max_logits_bytes(micro, args.n_heads // p.tp, int(seq_len / p.cp), elt)
        # DDP's gradients are views into its buckets (gradient_as_bucket_view): one bucket of scratch for the
        # all-reduce in flight, no larger than the gradients it holds. FSDP's reduce-scatter buffers are one
        # block's: counted in "gathered".
        ddp_like = p.data_parallel in ("ddp", "zero1") and dims.dp_size * dims.cp > 1
        part["buckets"] = min(p.ddp_bucket_mb * 2**20, n * GRAD_BYTES) if ddp_like else 0.0
        part["grad_copy"] = grad_copy_bytes(args, p, tables, first, ddp_like or accumulating) * (not sharded)
        part["step"] = step_transient_bytes(part, foreach_step)
        part["overhead"] = overhead_bytes + activation_slack * part["activations"]
        part["overhead"] += layers * gloo * block_host_bytes(sharded, p.tp)
        part["not_at_once"] = 0.0
        if getattr(mem, "optimizer_offload", False):
            _offload_to_host(part)
        elif gloo and sharded and p.pp == 1 and not (routed or accumulating):
            blocks = (block_split / p.tp + block_rep, layers, shards, mode == "zero2")
            part["not_at_once"] = _moments_apart(
                part, args, p.tp, tables, last, elt, blocks, transient, foreach_step
            )
        out.append(_with_total(part, args, ddp_like, shards if mode == "zero2" and shards > 1 else 1))
    return out


def _with_total(part: dict[str, float], args: ModelArgs, ddp_like: bool, held: int) -> dict[str, float]:
    """`part` with its total: the step's peak, or initialisation's where that is higher (a large vocabulary over
    many shards). `held`: the shards zero2 keeps its weights in until the step gathers them (else 1)."""
    part["init"] = init_peak_bytes(part, init_draw_bytes(args), ddp_like, held)
    part["total"] = max(sum(part[k] for k in PARTS), part["init"])
    return part


def _whole_until_last_microbatch(
    part: dict[str, float],
    p: ParallelConfig,
    mode: str,
    n: float,
    n_micro: int,
    accumulating: bool,
    elt: int,
    units: tuple[float, float, int],
    gloo: bool,
) -> None:
    """What a sharded data-parallel mode holds whole until its last micro-batch, set in `part`: the gradients when
    accumulating without a pipeline (grad_sync "step"), and under a pipeline the stage's gradients and gathered
    weights. The sharded gradients are not alive beside them: the step's zero_grad freed them, and the last
    backward makes each unit's as it frees that unit's whole ones (memory_matrix cases 7 and 8: one sharded copy
    over). `units`: the parameters of one block and of the root unit on this rank, and the shards they are split in."""
    if p.pp == 1 and p.grad_sync == "step" and accumulating:  # accumulating: unsharded grads
        part["gradients"] = n * GRAD_BYTES
    if p.pp > 1 and n_micro > 1:
        # torch's pipeline stage defers FSDP's reduce-scatter and reshard to the last micro-batch's backward
        # (set_requires_gradient_sync / set_reshard_after_backward): until then the stage's gradients are whole
        # and its weights gathered (issue 35: pp 2 x fsdp 2 measured 47-58 MiB above the per-block count).
        part["gradients"] = n * GRAD_BYTES
        if mode in ("fsdp", "hsdp"):
            part["gathered"] = n * elt + _pp_transient_bytes(*units, elt, gloo)


def _pp_transient_bytes(block: float, rows: float, shards: int, elt: int, gloo: bool) -> float:
    """What a pipeline stage under FSDP2 adds to its gathered weights and whole gradients, at the fullest of its
    backward's moments: a block's all-gather (resharded after forward, gathered again in backward: the flat output
    beside the weights copied out of it), a block's reduce-scatter in the last backward (its fp32 input, gloo's
    clone of it and the sharded gradient it writes, less its weights resharded just before), the root unit's (its
    tables' and norm's `rows` the same way; on the first stage the first reduced, beside every whole gradient).
    memory_matrix cases 8 and 16."""
    return max(block * elt, ((1 + gloo + 1 / shards) * GRAD_BYTES - elt) * max(block, rows))


def _offload_to_host(part: dict[str, float]) -> None:
    """FSDP2's CPUOffloadPolicy: sharded parameters, gradients and AdamW state live on the host; the device keeps
    the gathered blocks (copied in per block) and the activations."""
    part["host"] = part["parameters"] + part["gradients"] + part["optimizer"]
    part["parameters"] = part["gradients"] = part["optimizer"] = 0.0


def foreach_step_bytes(part: dict[str, float]) -> float:
    """What torch's foreach AdamW (optimizer.implementation = "foreach") allocates in its step: sqrt(v) of every
    parameter this rank steps, as one list of new tensors (4 bytes per parameter, half the fp32 optimizer state)
    before its addcdiv. Measured on 2 gloo ranks, ddp, 16M parameters: 61.9 MiB against 62.0
    (tests/distributed/test_step_memory.py); 61M parameters: a 1470 MiB peak, 200 MiB above the for-loop AdamW's
    (issue 35). The fused kernel, the default on a CPU as on CUDA, holds none."""
    return part["optimizer"] / 2


def grad_copy_bytes(args: ModelArgs, p: ParallelConfig, tables: int, first: bool, adds: bool) -> float:
    """A rank's fresh gradient beside the one it goes into, where no FSDP shards them (issue 35: memory_matrix cases
    11 and 15 once the fused AdamW's step no longer hid it). `adds`: the gradients already exist when backward makes
    a new one (DDP's bucket views, accumulation), so autograd's gradient of the largest matrix lives beside them until
    it is added in. Under tp, a vocabulary-split embedding's gradient comes whole from torch's DTensor and is split
    after it is accumulated (parallel/tensor_parallel.split_embedding_grad): the whole table beside this rank's rows.
    `tables`: the vocabulary tables on this rank's stages; `first`: it holds the embedding."""
    table = args.vocab_size * args.dim
    largest = max(table * (tables > 0), args.dim * max(args.ffn_hidden, args.dim)) / p.tp
    routed = ffn_shape(args).routed
    if routed:  # an MoE layer's experts: each of its three weights is one [experts, a, b] tensor
        largest = max(largest, routed / 3 / getattr(p, "ep", 1))
    return max(largest * adds, table * (first and p.tp > 1)) * GRAD_BYTES


def step_transient_bytes(part: dict[str, float], foreach_step: bool) -> float:
    """What the optimizer step adds to the peak beyond the backward's transients, which are freed by then (the
    step's peak is the state plus foreach_step_bytes; the backward's, the state plus the gathered blocks, the
    activations, the logits, the buckets and the gradient copy): the larger of the two counts once."""
    if not foreach_step:
        return 0.0
    backward = part["gathered"] + part["activations"] + part["logits"] + part["buckets"] + part["grad_copy"]
    return max(0.0, foreach_step_bytes(part) - backward)


def _blocks_and_loss(
    args: ModelArgs,
    p: ParallelConfig,
    mem: MemoryConfig,
    micro: int,
    seq_len: int,
    elt: int,
    mechanism: str,
    layers_in_flight: float,
    last: bool,
    cpu: bool,
    compiled: bool = False,
) -> tuple[float, float, float]:
    """(activations, logits, the recomputed block's transient) at the backward's peak: the blocks' saved
    activations for the layers and micro-batches in flight, and the loss's peak on the last stage, one chunk of
    tokens at a time (issue 40) or whole (model.loss). The block recomputed in backward holds its transient after
    the loss's backward has freed the logits, never both at once: on a `cpu`, where a freed tensor goes back to the
    kernel at once (the pinned mmap threshold), only the transient's excess over the loss's peak adds to it
    (memory_matrix --activations, cases 3 and 5: 46-56 MiB too much with both). On CUDA both count: the caching
    allocator keeps the loss's freed blocks reserved, and the reserve is what runs out (not measured here)."""
    per_layer, transient = activation_bytes(
        args, p, micro, seq_len, elt, mem.recompute, mem.recompute_every, mechanism, compiled
    )
    logits = last * _logits_bytes(args, p, micro, seq_len, elt)
    head = last * head_activation_bytes(args, p, micro, seq_len, elt, mechanism)
    return (
        per_layer * layers_in_flight + head + (max(transient - logits, 0.0) if cpu else transient),
        logits,
        transient,
    )


def _moments_apart(
    part: dict[str, float],
    args: ModelArgs,
    tp: int,
    tables: int,
    last: bool,
    elt: int,
    blocks: tuple[float, int, int, bool],
    transient: float,
    foreach_step: bool,
) -> float:
    """What the sum of FSDP2's parts counts on a CPU (gloo; a freed tensor goes back to the kernel at once) that is
    never alive at once (<= 0): the peak is the fullest of its moments, each with what is alive then.
    - The loss's backward: no sharded gradient exists yet (the step's zero_grad freed them; not so when
      accumulating, nor under a pipeline, which defers the reduce-scatter), no block is gathered but the last (kept
      gathered after its forward), the root unit at its backward moment (memory_matrix --activations, fsdp in bf16
      at 2048 tokens: the sum 11-16% over; tests/distributed/test_loss_moment_memory.py).
    - A block's backward, at its end: its weights, the next block's prefetched, its unsharded gradient and the
      previous block's reduce-scatter input, which FSDP2 keeps until the next reduce-scatter starts
      (reduce_scatter_max_input_buffers, 1 in torch 2.13): the gathered part. The sharded gradients are those of
      the blocks already reduced: all but this one and the one before (the second block's end is the fullest).
      On 2 ranks two sharded gradients are one block, so the sum of every part's largest was exact there; on 4 and
      more it fell short by a block less two shards (memory_matrix case 2, 0.97; the issue's 16 ranks, 51 MiB).
    - The root unit's reduce-scatter, after every block: its moment beside the first block's kept input and every
      sharded gradient, its own being written.
    - The step: every sharded gradient and foreach AdamW's transient.
    zero2 (FSDP2 without resharding after forward) holds each rank's fp32 shard of the weights always and the
    whole weights in the compute dtype (`whole`) from their all-gather in forward to their backward, where the sum
    counts the whole fp32 copy ZeRO-2 replicates, its 16-bit one and every sharded gradient at once. Its fullest
    moments: the last block's all-gather in forward (its flat output and the previous block's, which FSDP2 holds
    until the next copy-out: memory_matrix case 5's peak; tests/distributed/test_zero2_memory.py), the loss's
    backward, the last block's reduce-scatter (resharded first: its fp32 input, gloo's clone, the shard it writes).
    `blocks`: one block's parameters on this rank, the blocks, the shards, and whether the mode is zero2;
    `transient`: the recomputed block's (_blocks_and_loss)."""
    block, layers, shards, zero2 = blocks
    kept = part["activations"] - max(transient - part["logits"], 0.0)
    state = (
        part["parameters"] / (shards if zero2 else 1) + part["optimizer"] + part["overhead"] + part["buckets"]
    )
    _, backward, reduce_scatter = root_unit_moments(args, tables, last, tp, elt, gloo=True)
    root = state + block * GRAD_BYTES + reduce_scatter + part["gradients"]  # its own shard is being written
    step = state + part["gradients"] + (foreach_step_bytes(part) if foreach_step else 0.0)
    if zero2:
        whole = part["parameters"] / PARAM_BYTES * elt
        output_grad = last * args.vocab_size * args.dim / tp * elt  # the root's weights are in `whole`
        moments = (
            state + whole + 2 * block * elt + kept,
            state + whole + kept + part["logits"] + output_grad,
            state + whole + kept + transient + block * ((2 + 1 / shards) * GRAD_BYTES - elt),
        )
    else:
        one = block * GRAD_BYTES / shards  # a block's sharded gradient
        moments = (
            state + kept + part["logits"] + backward + block * elt,
            state + kept + transient + _gathered_blocks(block, elt) + backward + max(layers - 2, 0) * one,
        )
    return max(*moments, root, step) - sum(part[k] for k in PARTS)


def _logits_bytes(args: ModelArgs, p: ParallelConfig, micro: int, seq_len: int, elt: int) -> float:
    """The loss's peak on the last stage (models/loss.py's loss_activation_bytes) as model.loss computes it: under
    sequence parallel its chunks are whole sequences; compiled, its logits are of the compute dtype (`elt`)."""
    sp_rows = seq_len if p.tp > 1 and p.sequence_parallel else 0
    tokens = micro * seq_len / p.cp
    return loss_activation_bytes(tokens, args.vocab_size, args.dim, p.tp, sp_rows, args.loss, elt)


def root_unit_bytes(
    args: ModelArgs, tables: int, last: bool, tp: int, elt: int, counted: bool = False, gloo: bool = False
) -> float:
    """What FSDP2's root unit (the embedding, final norm and output of this rank's stages) adds to the gathered
    blocks, at the largest of three moments: its all-gather (the flat buffer and the weights copied out of it), its
    backward (still gathered: FSDP does not reshard the root after forward, beside the output's whole gradient),
    and its reduce-scatter after the last block (resharded by then; every table's whole gradient and the flat fp32
    copy the reduce-scatter sends). Untied in fp32 that is 4 tables; measured 4.1-4.2 tables above the other
    terms on 2 and 8 gloo ranks (issue 35, a 31 MiB table). `counted`: the gathered weights are already in
    "parameters" (zero2 keeps them from forward to backward). `gloo`: the collectives run on gloo (a CPU), whose
    reduce-scatter (ProcessGroupGloo::reduce_scatter_tensor_coalesced, torch 2.13) clones the whole flat input and
    all-reduces the clone: 2 fp32 copies of the rows, beside one table's whole gradient still held (the others are
    freed once copied in). Measured at the root's reduce-scatter on 2 and 4 gloo ranks, untied, vocab 50304 x 512:
    491 MiB above the sharded gradients, where the other two moments give 393 (benchmarks/memory_matrix.py cases
    9 and 10; tests/distributed/test_root_unit_memory.py). Under zero2 the whole parameters it counts in
    "parameters" are resharded by then, which more than covers the clone."""
    return max(root_unit_moments(args, tables, last, tp, elt, counted, gloo))


def root_unit_moments(
    args: ModelArgs, tables: int, last: bool, tp: int, elt: int, counted: bool = False, gloo: bool = False
) -> tuple[float, float, float]:
    """root_unit_bytes at each of its moments: (all-gather, backward, reduce-scatter)."""
    if not tables:
        return 0.0, 0.0, 0.0
    table = args.vocab_size * args.dim / tp
    rows = tables * table + last * args.dim
    gather = 0.0 if counted else 2 * rows * elt
    backward = 0.0 if counted else rows * elt + table * elt
    reduce_scatter = rows * (elt + GRAD_BYTES)
    if gloo and not counted:
        reduce_scatter = max(reduce_scatter, 2 * rows * GRAD_BYTES + table * elt)
    return gather, backward, reduce_scatter


def _state_bytes(mode: str, n: float, shards: int, block_params: float, elt: int) -> dict[str, float]:
    """Parameters, gradients and AdamW state of `n` parameters under each data-parallel mode (ZeRO, Rajbhandari
    et al. 2020): ddp replicates all; zero1 shards the optimizer state; zero2 (FSDP2 without resharding after
    forward) also the gradients; fsdp/hsdp also the parameters, plus the blocks gathered at a time
    (_gathered_blocks; tests/distributed/test_step_memory.py holds them against the kernel). Under
    16-bit compute without FSDP, autocast caches a 16-bit copy of every weight it casts (ddp, zero1), and zero2
    keeps the gathered 16-bit parameters: `n` x 2 bytes more; zero2 holds two blocks' all-gather outputs at its
    last all-gather in forward (_moments_apart)."""
    stage = {"ddp": 0, "zero1": 1, "zero2": 2}.get(mode, 3)
    part = model_state_bytes(n, stage, shards if mode != "ddp" else 1)
    if stage == 3 and shards > 1:
        part["gathered"] = _gathered_blocks(block_params, elt)
    else:
        part["gathered"] = n * elt if elt < PARAM_BYTES else 0.0
    if stage == 2 and shards > 1:
        # the last block's all-gather in forward: its flat output and the previous block's, which FSDP2 holds
        part["gathered"] += 2 * block_params * elt
    return part


def _gathered_blocks(block_params: float, elt: int) -> float:
    """FSDP2's blocks at a block's backward: its weights and the next block's prefetched in the compute dtype, its
    unsharded gradient in the compute dtype, and the previous block's reduce-scatter input in fp32 (the reduce
    dtype), which FSDP2 holds until the next reduce-scatter starts (reduce_scatter_max_input_buffers)."""
    return block_params * (3 * elt + GRAD_BYTES)


def describe(estimate: dict[str, float]) -> str:
    """e.g. "43.1 GiB per process (parameters 3.74, gradients 3.74, ..., overhead 2)"; zero parts left out; the
    initialisation peak named when it is the total."""
    parts = ", ".join(f"{k.replace('_', ' ')} {estimate[k] / GiB:.3g}" for k in PARTS if estimate[k])
    init = estimate.get("init", 0.0)
    if init >= estimate["total"] > sum(estimate[k] for k in PARTS):
        parts += f"; at initialisation {init / GiB:.3g}: its share and the largest parameter drawn whole"
    return f"{estimate['total'] / GiB:.3g} GiB per process ({parts})"


def memory_problem(
    args: ModelArgs,
    parallel: ParallelConfig,
    training: TrainingConfig,
    seq_len: int,
    world_size: int,
    *,
    device_bytes: int,
    where: str = "GPU",
    local_batch: int | None = None,
    overhead_bytes: int = GPU_OVERHEAD_BYTES,
    memory: MemoryConfig | None = None,
    precision: str = "fp32",
    qk_clip: bool = False,
    foreach_step: bool = False,
    gloo: bool = False,
    error: float = 0.0,
) -> str | None:
    """None if the fullest rank fits in `device_bytes` with its stated `error` to spare (estimate x (1 + error));
    else what it needs, by how much that is over (or that it is within its error of the limit), and the single
    knobs (checked with the same estimate and margin) that would make it fit."""
    memory = memory or MemoryConfig()
    room = device_bytes / (1 + error)  # the largest estimate accepted

    def estimate(
        p: ParallelConfig, t: TrainingConfig, world: int = world_size, m: MemoryConfig = memory
    ) -> dict[str, float] | None:
        try:
            return per_rank_bytes(
                args, p, t, seq_len, world, local_batch=local_batch, overhead_bytes=overhead_bytes, memory=m,
                precision=precision, qk_clip=qk_clip, foreach_step=foreach_step, gloo=gloo,
            )  # fmt: skip
        except (ConfigError, ValueError):  # a layout that does not tile or split: not a fix
            return None

    need = estimate(parallel, training)
    if need is None:  # the layout itself does not tile: the layout check says why
        return None
    if need["total"] <= room:
        return None
    fixes: dict[str, str] = {}
    for knob, p, t, m in _candidates(args, parallel, training, world_size, memory):
        e = estimate(p, t, world_size, m)
        # The first that fits of each knob: candidates come in the order least change first.
        if e is not None and e["total"] <= room and knob.split()[0] not in fixes:
            fixes[knob.split()[0]] = f"{knob} ({e['total'] / GiB:.3g} GiB)"
    if not fixes:
        fixes["more"] = _more_ranks(parallel, training, world_size, room, estimate)
    if need["total"] <= device_bytes:
        over = (
            f"with the estimate's stated error of {100 * error:.0f}% (the worst miss benchmarks/memory_matrix.py "
            f"measured) up to {need['total'] * (1 + error) / GiB:.2f} GiB: within its error of the "
            f"{device_bytes / GiB:.2f} GiB {where}, where the kernel may kill it"
        )
    else:
        over = f"{(need['total'] - device_bytes) / GiB:.1f} GiB more than the {device_bytes / GiB:.1f} GiB {where}"
    return f"the fullest rank needs an estimated {describe(need)}, {over}; to fit: {'; or '.join(fixes.values())}"


def _candidates(
    args: ModelArgs, p: ParallelConfig, t: TrainingConfig, world_size: int, m: MemoryConfig
) -> list[tuple[str, ParallelConfig, TrainingConfig, MemoryConfig]]:
    """One-knob changes to try: shard more state, split the model more, recompute, or a smaller micro-batch. DDP
    and zero1 cannot hold tensor-parallel DTensors or run in pipeline stages, so tp/pp are tried under fsdp there."""
    out = []
    mode = p.data_parallel if p.data_parallel in ("zero2", "fsdp", "hsdp") else "fsdp"
    if p.data_parallel != mode:
        out.append(("--parallel.data_parallel fsdp", dataclasses.replace(p, data_parallel="fsdp"), t, m))
    note = "" if mode == p.data_parallel else " with --parallel.data_parallel fsdp"
    tp = p.tp * 2
    if args.n_kv_heads % tp == 0 and world_size % (tp * p.pp * p.cp * p.dp_replicate) == 0:
        tp_layout = dataclasses.replace(p, tp=tp, dp_shard=-1, data_parallel=mode)
        out.append((f"--parallel.tp {tp}{note}", tp_layout, t, m))
    pp = p.pp * 2
    if pp <= args.n_layers and world_size % (p.tp * pp * p.cp * p.dp_replicate) == 0:
        pp_layout = dataclasses.replace(p, pp=pp, dp_shard=-1, data_parallel=mode)
        out.append((f"--parallel.pp {pp}{note}", pp_layout, t, m))
    # Least recompute first: selective keeps the matmul outputs, full only each block's input.
    stronger = {
        "none": ("selective", "full"),
        "every_k": ("selective", "full"),
        "selective": ("full",),
        "selective_op": ("full",),
    }
    for policy in stronger.get(m.recompute, ()):
        out.append((f"--memory.recompute {policy}", p, t, dataclasses.replace(m, recompute=policy)))
    # Divisors only, so that the global batch stays divisible by micro_batch x data-parallel ranks.
    for mb in (d for d in range(t.micro_batch - 1, 0, -1) if t.micro_batch % d == 0):
        out.append((f"--training.micro_batch {mb}", p, dataclasses.replace(t, micro_batch=mb), m))
    return out


def _more_ranks(p: ParallelConfig, t: TrainingConfig, world_size: int, device_bytes: int, estimate) -> str:
    """No single knob fits at this world size: the smallest multiple of it (up to 64x) at which fsdp with a
    micro-batch of 1 would."""
    fsdp = dataclasses.replace(p, data_parallel="fsdp", dp_shard=-1, dp_replicate=1)
    one = dataclasses.replace(t, micro_batch=1)
    for k in (2, 4, 8, 16, 32, 64):
        e = estimate(fsdp, one, world_size * k)
        if e is not None and e["total"] <= device_bytes:
            return f"more devices: fsdp over {world_size * k} ranks with --training.micro_batch 1 ({e['total'] / GiB:.1f} GiB)"
    return "more devices or a smaller model.preset: not even fsdp over 64x the ranks fits"


def fits_in_memory_problems(cfg: Config, layout: Layout, args: ModelArgs) -> list[str]:
    """Refuse a layout whose fullest rank cannot hold its share of the model (ZeRO sharding, tp and pp splits),
    its activations at the configured micro-batch and the logits, instead of dying in the allocator minutes later;
    the message says by how much and which knob would fit (the estimate: per_rank_bytes)."""
    have, where, overhead = device_memory(cfg, layout.world_size)
    problem = memory_problem(
        args,
        cfg.parallel,
        cfg.training,
        cfg.data.seq_len,
        layout.world_size,
        device_bytes=have,
        where=where,
        local_batch=layout.local_batch,
        overhead_bytes=overhead,
        memory=cfg.memory,
        precision=cfg.precision.compute,
        qk_clip=cfg.optimizer.qk_clip > 0,
        foreach_step=_foreach_step(cfg),
        gloo=where != "GPU",  # a CPU's workers run gloo (root_unit_bytes)
        error=0.0 if where == "GPU" else CPU_ESTIMATE_ERROR,  # measured on a CPU host only
    )
    return [f"model.preset '{cfg.model.preset}': {problem}"] if problem else []


def memory_estimate(cfg: Config, world_size: int) -> dict[str, float]:
    """The estimate fits_in_memory_problems holds against this host or GPU: per_rank_bytes of the fullest rank, by
    part, with the CPU's per-process terms where the workers run on this host (benchmarks/memory_matrix.py compares
    it with the kernel's figures)."""
    layout = Layout.of(cfg, world_size)
    args = resolve_model_args(cfg.model, tokenizer_vocab(cfg.data.tokenizer), cfg.data.seq_len, moe=cfg.moe)
    _, where, overhead = device_memory(cfg, world_size)
    return per_rank_bytes(
        args,
        cfg.parallel,
        cfg.training,
        cfg.data.seq_len,
        world_size,
        local_batch=layout.local_batch,
        overhead_bytes=overhead,
        memory=cfg.memory,
        precision=cfg.precision.compute,
        qk_clip=cfg.optimizer.qk_clip > 0,
        foreach_step=_foreach_step(cfg),
        gloo=where != "GPU",
    )


def _foreach_step(cfg: Config) -> bool:
    """AdamW steps with its foreach kernels (what the memory check counts for the step: step_transient_bytes)."""
    return adamw_implementation(cfg.optimizer.implementation) == "foreach"


def device_memory(cfg: Config, world_size: int) -> tuple[int, str, int]:
    """(bytes one process may use, what they are, the framework overhead to count): a GPU's total memory, or on
    CPU this process's share of the host memory (the node's processes share it)."""
    cuda = uses_cuda(cfg.training.device)
    if cuda:
        return torch.cuda.get_device_properties(0).total_memory, "GPU", GPU_OVERHEAD_BYTES
    local = max(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), 1)
    # Before launch, what the host has free now; a worker, whose peers already hold their share, checks against
    # the physical memory (its launcher made the first check).
    host = host_memory_bytes()
    where = f"host memory share ({host / GiB:.1f} GiB available now over {local} local process(es))"
    return host // local, where, cpu_process_bytes(cfg, world_size)


def cpu_process_bytes(cfg: Config, world_size: int) -> int:
    """A CPU process's framework bytes (the interpreter, torch's kernels, gloo) as this CPU's probe or calibration
    measured them, cached for its CPU model and torch (`plan`, `train --dry-run`); CPU_OVERHEAD_BYTES where nothing
    was measured. It depends on the CPU: 289-365 MiB on an AMD EPYC, 372-449 on an Intel Xeon with AMX, so the
    built-in figure alone left the check 50-130 MiB a process short on the latter (issue 35)."""
    profile = load_profile("cpu", resolve_cache_dir(cfg.data))
    if profile.source == UNCALIBRATED:
        return CPU_OVERHEAD_BYTES
    return profile.process_bytes(world_size, cfg.precision.compute)
