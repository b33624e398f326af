"""The one typed config tree: a dataclass per section, loaded from TOML plus dotted CLI overrides.

Each component receives only its own section. This module is a leaf of plain dataclasses: reading TOML, overrides
and the type checks live beside it in config/io.py (`parse_config`), validation in scaletrain/validate.py
(`load_config`), which reports every problem at once as a `ConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ModelConfig:
    preset: str = "debug"
    """Named architecture (models/presets.py, docs/models.md): debug, 125M, 1B, 8B, 70B, 405B (Llama); debug_moe,
    mixtral_8x7b, deepseek_moe_16b (MoE); debug_qwen3, qwen3_0.6b, qwen3_1.7b, qwen3_4b, qwen3_8b, qwen3_14b,
    qwen3_32b, debug_qwen3_moe, qwen3_30b_a3b, qwen3_235b_a22b (Qwen3); debug_gpt_oss, gpt_oss_20b, gpt_oss_120b
    (GPT-OSS); debug_deepseek_v3, deepseek_v3_671b (DeepSeek-V3). The fields below, when set, override it."""
    dim: int | None = None
    """Hidden size."""
    n_layers: int | None = None
    """Number of transformer blocks."""
    n_heads: int | None = None
    """Attention (query) heads."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); must divide n_heads."""
    ffn_hidden: int | None = None
    """SwiGLU hidden size."""
    vocab_size: int | None = None
    """Embedding rows. Unset: the tokenizer's vocabulary rounded up to a multiple of 64."""
    norm_eps: float | None = None
    """RMSNorm epsilon."""
    rope_theta: float | None = None
    """RoPE base frequency."""
    rope_scaling: Literal["none", "llama3", "yarn"] | None = None
    """RoPE frequency scaling for long context: Llama 3.1's, YaRN's (GPT-OSS), or none."""
    rope_scaling_factor: float | None = None
    """Llama 3 RoPE scaling: factor."""
    rope_original_max_len: int | None = None
    """Llama 3 RoPE scaling: context length the frequencies were trained for."""
    rope_yarn_truncate: bool | None = None
    """YaRN: round its correction range to whole dimensions (transformers' default); GPT-OSS does not."""
    tie_embeddings: bool | None = None
    """Share the input embedding with the output projection."""
    init_std: float = 0.02
    """Std of the normal init; output projections of each block are scaled down by depth."""
    init_from: str = ""
    """Start from existing weights: "hf:DIR" reads a Hugging Face directory (a family of docs/models.md) (safetensors only)."""
    attention: Literal["auto", "flash", "efficient", "cudnn", "math", "flex"] = "auto"
    """Attention kernel. auto: SDPA's own pick, and for masks FlexAttention on CUDA, masked SDPA elsewhere;
    flash/efficient/cudnn/math: force that SDPA backend; flex: FlexAttention throughout (CUDA only)."""
    loss: Literal["chunked", "whole", "whole_compiled"] = "chunked"
    """How the output layer and cross-entropy are computed (the same loss either way, to fp rounding). chunked:
    fused with the output layer a chunk of tokens at a time, so the [tokens x vocab] logits are never whole.
    whole: the micro-batch's logits at once, then fp32 cross-entropy, as torchtitan computes it: 12 bytes per
    logit at its peak (models/loss.py), 23.5 GiB for 2 x 8192 tokens of Llama 3's vocabulary. whole_compiled:
    the same with the cross-entropy torch.compile'd, as torchtitan runs it with compile since 2025: the logits and
    their gradient at the peak, 4 bytes a logit under bf16 (not with parallel.tp > 1). A model.* field
    (not training.* or memory.*) because the model's forward computes the loss, in every layout and in
    evaluation, as it runs model.attention's kernel."""
    window: int | None = None
    """Sliding-window attention (Mistral style): query i sees keys i - window < j <= i. 0: off (full causal).
    Unset: the preset's (0 but for GPT-OSS's 128)."""
    window_every: int | None = None
    """With model.window: the window on every k-th layer (layers 0, k, 2k, ...); 1: all, 2: every other. Unset:
    the preset's (1; GPT-OSS 2)."""
    family: Literal["llama", "qwen3", "gpt_oss", "deepseek_v3"] | None = None
    """The Hugging Face family the model converts as (`convert --to hf`, model.init_from): llama (Llama, or
    Mixtral with MoE), qwen3 (Qwen3, or Qwen3-MoE), gpt_oss, deepseek_v3. Unset: the preset's. It names the
    adapter only; the computation follows the fields (qk_norm, head_size, ...), checked against it at export."""
    head_size: int | None = None
    """Channels per attention head; 0: dim / n_heads. Qwen3 and GPT-OSS use heads wider or narrower than that."""
    qk_norm: bool | None = None
    """RMSNorm over each head's query and key before RoPE (Qwen3)."""
    attention_bias: bool | None = None
    """Biases on the query, key, value and output projections (GPT-OSS)."""
    attention_sinks: bool | None = None
    """A learned logit per head added to each softmax's denominator, so a head may attend to nothing (GPT-OSS)."""

    q_lora_rank: int | None = None
    """Multi-head latent attention (DeepSeek-V3): the query latent's rank; 0: queries straight from the hidden state."""
    kv_lora_rank: int | None = None
    """Multi-head latent attention (DeepSeek-V2/V3) when > 0: keys and values from a latent of this rank, which is
    all a decoding cache keeps (with the rotary key); 0: grouped-query attention."""
    qk_nope_head_dim: int | None = None
    """MLA: each head's query/key channels without position."""
    qk_rope_head_dim: int | None = None
    """MLA: each head's query/key channels that carry RoPE (the key part shared by all heads)."""
    v_head_dim: int | None = None
    """MLA: each head's value channels."""
    mtp_depth: int | None = None
    """Multi-token prediction (DeepSeek-V3): 1 adds one MTP module (a block predicting the token after next) whose
    loss is added to the training loss; 0: off. Evaluation and generation never run it."""
    mtp_loss_coef: float | None = None
    """The MTP loss's weight (DeepSeek-V3's lambda: 0.3, then 0.1); the logged training loss includes it."""


@dataclass
class MoEConfig:
    """Mixture of experts (docs/moe.md). The shape fields, when set, override the preset's (a dense preset has
    n_experts 0); the rest are training choices."""

    n_experts: int | None = None
    """Routed experts per MoE layer; 0: a dense model (no MoE). Unset: the preset's."""
    top_k: int | None = None
    """Experts each token is routed to."""
    hidden: int | None = None
    """SwiGLU hidden size of each expert (and of each shared expert)."""
    shared_experts: int | None = None
    """Experts every token goes through besides its routed ones (DeepSeek-MoE); 0: none."""
    router: Literal["softmax", "sigmoid"] | None = None
    """Router scores: softmax over the experts (Mixtral, Switch) or independent sigmoids (DeepSeek-V3)."""
    norm_topk: bool | None = None
    """Divide each token's top-k weights by their sum (Mixtral; always with the sigmoid router)."""
    every: int | None = None
    """MoE on every k-th block (blocks k-1, 2k-1, ...; 1: all, 2: every other), dense SwiGLU elsewhere."""
    first_dense: int | None = None
    """The first N blocks stay dense whatever `every` says (DeepSeek-MoE keeps block 0 dense)."""
    bias: bool | None = None
    """Biases on the router and on each expert's projections (GPT-OSS)."""
    swiglu_limit: float | None = None
    """> 0: GPT-OSS's clamped SwiGLU in the experts, gate clamped above at the limit and up to [-limit, limit],
    gate * sigmoid(1.702 gate) * (up + 1); 0: plain SwiGLU."""
    capacity_factor: float = 0.0
    """0: dropless (every routed token is computed). > 0: each expert takes at most ceil(factor x seq_len x top_k /
    n_experts) tokens of each sequence, the first ones in order; the rest of its tokens are dropped (they keep only
    the residual and their other experts) and counted in moe_dropped."""
    aux_loss_coef: float = 0.01
    """Load-balancing loss (Switch/GShard form: n_experts x sum_e f_e P_e per sequence), added to the training loss
    with this weight; 0: off."""
    z_loss_coef: float = 0.0
    """Router z-loss (ST-MoE: mean squared logsumexp of the router logits) weight; 0: off."""
    n_group: int | None = None
    """Group-limited routing (DeepSeek-V3): the experts in this many equal groups; 1: off."""
    topk_group: int | None = None
    """With n_group > 1: each token's top_k experts come from its topk_group best groups (a group scores the sum of
    its two best scores)."""
    route_scale: float | None = None
    """The routed experts' weights multiplied by this (DeepSeek-V3's routed_scaling_factor, 2.5); 1: off."""
    bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): after each step every expert's routing bias moves by this much
    towards the mean load (up if under-loaded, down if over); the bias only selects experts, never weights them.
    0: off."""
    imbalance_threshold: float = 2.0
    """A `moe_imbalance` event when some layer's max/mean tokens per expert stays above this ..."""
    imbalance_steps: int = 20
    """... for this many consecutive steps (again only after it has come back under)."""


@dataclass
class SourceConfig:
    path: str = ""
    """A file, a directory (all files below it) or a glob."""
    format: Literal["auto", "text", "jsonl", "parquet", "hf_disk", "tokens"] = "auto"
    """How to read documents: a whole text file each, a jsonl line each, a parquet row each, a row of a Hugging
    Face datasets directory written by save_to_disk (hf_disk), or token ids tokenised already (tokens: .npy, or
    raw .bin with data.sources[i].dtype), used as they are. auto: by suffix (.npy: tokens), and hf_disk for a
    directory holding state.json and dataset_info.json."""
    field: str = "text"
    """The jsonl key, parquet or hf_disk column that holds the text."""
    dtype: Literal["", "uint16", "uint32", "int32", "int64"] = ""
    """format = "tokens", raw .bin files: the dtype of their token ids (nanoGPT writes uint16, Megatron uint16 or
    int32); a .npy carries its own."""
    weight: float = 1.0
    """Relative share of training samples drawn from this source (data mixture); with data.streaming, the share
    before data.schedule's first stage (0: none until a stage gives it one)."""
    name: str = ""
    """What logs, metrics (data_share/NAME) and `scaletrain data-position` call it. Empty: source0, source1, ..."""
    endpoint_url: str = ""
    """s3:// sources: the S3 endpoint (an S3-compatible store); empty: AWS_ENDPOINT_URL or AWS's own. gs:// sources:
    the GCS endpoint (an emulator, a private endpoint); empty: STORAGE_EMULATOR_HOST or Google's own."""
    profile: str = ""
    """s3:// sources: the AWS profile (~/.aws/credentials) for its credentials. Empty: AWS_PROFILE, the
    AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY environment, or AWS's default chain."""


@dataclass
class MixStage:
    """One stage of data.schedule (data.streaming): the sources' weights from a point of training on."""

    start: str = "0"
    """Where the move to these weights begins, in tokens consumed: a count ("2e9", "500000") or a share of the
    run's tokens ("80%")."""
    end: str = ""
    """Where these weights are reached: the weights go linearly from the previous ones between start and end (a
    blend). Empty: at start (a step change)."""
    weights: list[float] = field(default_factory=list)
    """One relative weight per data source, in data.sources order (>= 0, a positive sum)."""


@dataclass
class DataConfig:
    sources: list[SourceConfig] = field(default_factory=list)
    """Training data. Empty: the running interpreter's standard-library source files (no download)."""
    tokenizer: str = "byte"
    """'byte', or the path of a Hugging Face tokenizer.json."""
    seq_len: int = 256
    """Tokens per training sequence; documents are packed with an end-of-document token between them."""
    val_fraction: float = 0.01
    """Share of each source's sequences held out for validation."""
    cache_dir: str = ""
    """Where prepared token shards are kept. Empty: $SCALETRAIN_CACHE or ~/.cache/scaletrain."""
    workers: int = 0
    """Processes used to tokenise. 0: one per CPU core, at most 8."""
    document_mask: bool = False
    """Attend only within each packed document (split at the end-of-document token), RoPE positions restarting
    at each; off: a token sees every earlier token of its window."""
    streaming: bool = False
    """Read the sources shard by shard while training (local paths or fsspec URLs: s3://, gs://, file://),
    tokenising as they come, instead of preparing token shards first; each source is read once per epoch, in an
    order shuffled per epoch; the mixture may follow data.schedule (docs/training.md)."""
    schedule: list[MixStage] = field(default_factory=list)
    """data.streaming: the mixture as a function of tokens consumed, stage after stage (before the first: the
    sources' weights). Empty: the sources' weights throughout."""
    when_dry: Literal["repeat", "stop"] = "repeat"
    """data.streaming: a source read to its end starts a new epoch in a new shuffled order (repeat), or ends the
    run, finished (exit 0), at the last whole step before it, with a checkpoint of that step (stop)."""
    stream_cache_mb: int = 2048
    """data.streaming: the local cache of remote shards (under data.cache_dir/stream), at most this many MiB;
    the least recently used shard not in use goes first."""
    read_ahead: int = 2
    """data.streaming: remote shards of each source fetched ahead of the one being read."""


@dataclass
class TrainingConfig:
    steps: int = 200
    """Optimizer steps to run."""
    global_batch: int = 32
    """Sequences per optimizer step, summed over data-parallel ranks and accumulation steps."""
    global_batch_tokens: int = 0
    """When >0, the global batch in tokens instead (must be a multiple of data.seq_len)."""
    micro_batch: int = 8
    """Sequences per forward/backward on one rank; the rest of the global batch is gradient accumulation."""
    seed: int = 1234
    """Seed for initialisation and data order."""
    deterministic: bool = False
    """Bit-reproducible CPU runs: deterministic kernels, fixed thread count."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when available, else CPU."""
    eval_interval: int = 50
    """Validation every N steps (and at the start and the end); 0 disables."""
    eval_sequences: int = 64
    """Validation sequences per evaluation."""
    threads: int = 0
    """torch intra-op threads per process; 0: the CPU cores divided by the local processes."""
    compile: bool = False
    """torch.compile each transformer block (in place: parameter names unchanged); the first step's compile time is
    reported apart from throughput."""
    batch_ramp: str = ""
    """"start:steps": grow the global batch from start sequences to global_batch over the first steps steps
    (linear, in multiples of start); the learning-rate schedule counts tokens. Empty: off."""


@dataclass
class OptimizerConfig:
    lr: float = 3e-3
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay; never applied to norms and biases."""
    schedule: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    """Learning-rate shape after warmup; wsd = warmup-stable-decay."""
    warmup_steps: int = 20
    """Linear warmup from 0 to lr."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr."""
    decay_fraction: float = 0.2
    """wsd only: fraction of steps spent in the final decay."""
    implementation: Literal["auto", "foreach", "fused", "for-loop"] = "auto"
    """AdamW kernel; auto is torch's fused one on every device (a CPU's too: faster than foreach, no step transient)."""
    name: Literal["adamw", "muon"] = "adamw"
    """adamw: AdamW for every parameter. muon: Muon (momentum orthogonalised by Newton-Schulz) for the hidden
    matrices and MoE experts (per expert), AdamW with lr and weight_decay for embeddings, output, norms, biases."""
    muon_lr: float | None = None
    """muon only: peak lr of the Muon matrices (scheduled like lr); unset: lr (the update RMS matches AdamW's)."""
    muon_weight_decay: float | None = None
    """muon only: decoupled weight decay of the Muon matrices; unset: weight_decay."""
    muon_momentum: float = 0.95
    """muon only: momentum of the gradient buffer that is orthogonalised."""
    muon_nesterov: bool = True
    """muon only: orthogonalise the Nesterov look-ahead (gradient + momentum x buffer) instead of the buffer."""
    muon_ns_steps: int = 5
    """muon only: Newton-Schulz iterations (quintic, Jordan's coefficients); 5 gives singular values in ~[0.7, 1.2]."""
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """muon only: update scale; match_rms_adamw multiplies by 0.2 sqrt(max(A, B)) (Moonlight, so AdamW's lr
    transfers), original by sqrt(max(1, A/B)) (Jordan)."""
    qk_clip: float = 0.0
    """QK-clip threshold τ (MuonClip, Kimi K2), with any optimizer: after each step, the W_q/W_k rows of every
    attention head whose largest logit in the step exceeded τ are scaled so that it would peak at τ; 0: off."""


@dataclass
class ParallelConfig:
    data_parallel: Literal["ddp", "zero1", "zero2", "fsdp", "hsdp"] = "ddp"
    """How data-parallel ranks share the model: ddp replicates it; zero1 also shards optimizer state; zero2 also
    gradients; fsdp (ZeRO-3) also parameters; hsdp replicates across dp_replicate and shards within dp_shard."""
    dp_replicate: int = 1
    """Replica groups (hsdp only)."""
    dp_shard: int = -1
    """Data-parallel ranks inside a replica group; -1: the rest of the world after pp, cp, tp and dp_replicate."""
    tp: int = 1
    """Tensor-parallel ranks (Megatron-style column/row split of attention and MLP)."""
    sequence_parallel: bool = False
    """With tp > 1: also split norms and dropout-free regions along the sequence (Korthikanti et al. 2022)."""
    pp: int = 1
    """Pipeline stages (ranks); layers are split evenly, the first stage owns the embedding, the last the loss."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"] = "1f1b"
    """Pipeline schedule; the interleaved and V schedules run several stages per rank."""
    pp_microbatches: int = 0
    """Micro-batches per pipeline step; 0: the local batch divided by training.micro_batch."""
    pp_virtual_stages: int = 2
    """Stages per rank for interleaved_1f1b and interleaved_zb (zbv and dualpipev always use 2)."""
    cp: int = 1
    """Context-parallel ranks: each sequence is split over them and attention runs as ring attention."""
    ep: int = 1
    """Expert-parallel ranks: each MoE layer's experts are split over ep ranks carved from dp_shard, and tokens go to
    their experts' ranks by all-to-all. Needs data_parallel fsdp (experts are then sharded over the dp_shard / ep
    ranks that hold the same experts); must divide moe.n_experts and dp_shard."""
    cp_load_balance: bool = True
    """Zig-zag chunk order so that every context-parallel rank does the same causal-attention work."""
    grad_sync: Literal["step", "micro_batch"] = "step"
    """With gradient accumulation under fsdp/zero2/hsdp: step reduce-scatters once per optimizer step (1/m of the
    traffic; each rank holds its unsharded gradients until then), micro_batch after every micro-batch (ZeRO's
    sharded gradient memory, m x the traffic). DDP always all-reduces once per step."""
    ddp_bucket_mb: int = 25
    """DDP gradient bucket size in MiB."""
    auto: bool = False
    """`train` only: let the planner pick the layout for the launched world size (the sizes, data-parallel mode,
    schedule, micro-batches, recompute and micro-batch it predicts fastest among those that fit); the choice is
    logged and replaces the configured ones."""
    grad_compression: Literal["none", "bf16", "fp16", "powersgd"] = "none"
    """DDP communication hook (ddp and zero1 only): bf16/fp16 all-reduce gradients in half precision (half the
    bytes); powersgd sends a rank-r approximation of each gradient matrix with error feedback (Vogels et al.
    2019). See docs/performance.md (Communication)."""
    powersgd_rank: int = 1
    """PowerSGD: rank of the approximation of each gradient matrix (more: closer to the exact gradient)."""
    powersgd_warm_start: bool = True
    """PowerSGD: start each step's power iteration from the previous step's Q (checkpointed), not a random one."""
    powersgd_start_iter: int = 10
    """PowerSGD: plain all-reduce for the first N steps (>= 2: DDP settles its buckets in the first step)."""
    fsdp_prefetch: int = 0
    """FSDP2: all-gather the next k blocks' parameters ahead (forward and backward). 0: FSDP2's default (the next
    block, issued when it is needed); more overlaps more, at the memory of k gathered blocks."""
    reshard_after_forward: int | bool | Literal["auto"] = "auto"
    """FSDP2: free each block's gathered parameters after its forward (true; all-gather again in backward) or keep
    them (false: ZeRO-2's memory, one all-gather fewer), or an int N: keep them sharded over N ranks between
    forward and backward (N divides the shard size; the backward all-gather then stays within groups of N). auto:
    fsdp and hsdp reshard, zero2 does not, nor does any mode under a zero-bubble pipeline schedule."""


@dataclass
class MemoryConfig:
    recompute: Literal["none", "full", "every_k", "selective", "selective_op"] = "none"
    """Activation recompute: full re-runs each block's forward in backward (keeps only block inputs); every_k does
    so for every recompute_every-th block; selective keeps matmul and attention outputs and recomputes the
    element-wise ops and norms (Korthikanti et al. 2022); selective_op is torchtitan's per-op policy (its default
    selective AC): as selective, but every second Linear of a block (wk, wo, w3) is recomputed too (dense blocks
    without MLA only)."""
    recompute_every: int = 2
    """every_k only: recompute layers k-1, 2k-1, ... (every k-th block)."""
    activation_offload: bool = False
    """CUDA only: keep the activations saved for backward in pinned host memory (torch.autograd.graph.save_on_cpu)."""
    optimizer_offload: bool = False
    """CUDA with fsdp, zero2 or hsdp only: FSDP2's CPUOffloadPolicy keeps parameters, gradients and optimizer state on
    the host and runs the optimizer step on the CPU (ZeRO-Offload)."""


@dataclass
class PrecisionConfig:
    """Numeric precision, read by scaletrain/precision/ (docs/performance.md, Precision; QAT in docs/qat.md)."""

    compute: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"
    """Compute precision; parameters (master weights) and optimizer state stay fp32. fp16 adds dynamic loss
    scaling; fp8 (CUDA, compute capability >= 8.9, torchao) runs the blocks' Linear layers in float8 on top of bf16.
    See docs/performance.md (Precision)."""
    mechanism: Literal["auto", "autocast", "fsdp"] = "auto"
    """How bf16/fp16 are applied: autocast casts per op; fsdp uses FSDP2's MixedPrecisionPolicy (parameters cast
    at the all-gather, gradients reduced in precision.reduce_dtype). auto: fsdp where FSDP2 wraps the model
    (fsdp, zero2, hsdp over > 1 rank), autocast elsewhere."""
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of FSDP2's gradient reduce-scatter/all-reduce (fsdp, zero2, hsdp only); bf16 halves the traffic."""
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """With compute fp8: torchao's scaling granularity; tensorwise also all-gathers fp8 weights under FSDP2."""
    loss_scale_init: float = 65536.0
    """fp16 only: the initial loss scale (a power of two keeps scaling exact)."""
    loss_scale_growth_interval: int = 2000
    """fp16 only: double the loss scale after this many steps in a row without an overflow."""
    qat: Literal["none", "int8_int4", "int8_int8"] = "none"
    """Quantization-aware training (torchao): the transformer blocks' Linear layers train with fake int8 dynamic
    per-token activations and int4 (int8_int4) or int8 (int8_int8) grouped symmetric weights; `scaletrain convert
    --quantize` then writes the real quantised model. The embedding and output head stay in full precision."""
    qat_group_size: int = 32
    """With precision.qat: input channels per weight scale; must divide every block Linear's input size."""


@dataclass
class CheckpointConfig:
    enabled: bool = True
    """Save checkpoints into the run directory and resume from the newest committed one on the next start."""
    interval: int | Literal["auto"] = 0
    """Save every N steps; 0: no step-based saves (interval_minutes still bounds the time between saves); auto: the
    Young/Daly interval sqrt(2 x save cost x mtbf_hours) from the measured cost of the first save. Saves also happen
    at the end and on SIGTERM."""
    interval_minutes: float = 30.0
    """Save at least this often (minutes of wall time since the last save started), whichever of this and
    `interval` comes first, so that a crash loses at most about this much training whatever the step time. All
    ranks decide together (rank clocks agreed over the control group). 0: off. 30 bounds the expected loss to ~15
    minutes for an async save's few seconds of stall (< 0.5%); runs of a few minutes are not affected."""
    async_save: bool = True
    """Two stages: copy the state to host memory, resume training, write to storage in the background."""
    keep_last: int = 3
    """Keep the newest N committed checkpoints ..."""
    keep_every: int = 0
    """... plus every checkpoint whose step is a multiple of this (0: none)."""
    storage: str = ""
    """Where checkpoints go: empty: <run.dir>/checkpoints; or a path or fsspec URL (s3://..., gs://...)."""
    mtbf_hours: float = 24.0
    """Mean time between failures of the whole job, for interval = auto."""
    snapshot_interval: int = 0
    """The snapshot tier (checkpoint/memory_tier.py): a snapshot in host shared memory every N steps, replicated to a
    peer's slot, that survives a worker restart. 0: off. Needs room in /dev/shm for each rank's snapshot (its shard
    of the weights and optimizer state: ~3x the weights with AdamW) plus, with several ranks, a peer's replica, twice
    over while a new snapshot is written beside the kept one. Docker's default /dev/shm is 64 MiB (--shm-size).
    Where they do not fit, the tier turns itself off with a warning and a memory_tier_off event; storage checkpoints
    go on."""
    snapshot_max_mb: int = 2048
    """Bound on the host memory the snapshot tier may use per rank (own copy plus the peer's replica)."""
    snapshot_ttl_hours: float = 24.0
    """Snapshots of other jobs that wrote nothing for this long are removed from shared memory when a tier opens
    (a job that crashed for good leaves them behind). 0: never."""
    last_save_in_hf: bool = False
    """At the end of training (the final step), the job also writes its weights as a Hugging Face directory,
    <run.dir>/hf-step-NNNNNNNN (sharded safetensors, config.json, the tokenizer; fp32), gathered a tensor at a time
    by every rank and written by the first: transformers loads it, and model.init_from = "hf:DIR" starts a run from
    it. Weights only: a resume reads the DCP checkpoints, which also hold the optimizer state and the data position.
    Refused with parallel.pp > 1 (use `scaletrain convert --to hf` after the run)."""


FaultKind = Literal[
    "kill",
    "raise",
    "hang",
    "nan",
    "spike",
    "slow",
    "corrupt_checkpoint",
    "write_error",
    "kill_during_save",
    "bitflip",
    "compute_error",
]


@dataclass
class FaultConfig:
    kind: FaultKind | None = None
    """kill (SIGKILL), raise (an exception), hang (sleep forever), nan (NaN logits), spike (garbage targets),
    slow (a straggler), corrupt_checkpoint (flip bytes after the commit), write_error (ENOSPC inside the storage
    writer), kill_during_save (SIGKILL inside the storage writer), bitflip (one low mantissa bit of one parameter of
    the rank's shard flipped after the step's update: silent data corruption), compute_error (one activation of the
    rank's forward at that step 2^16 times too large, once: a transient fault of the device's arithmetic)."""
    rank: int | None = None
    """The rank it fires on; unset: every rank (corrupt_checkpoint: rank 0)."""
    step: int | None = None
    """The step it fires at (slow: the first step it slows; unset: from the start)."""
    factor: float | None = None
    """slow only: each step takes this many times as long (> 1)."""


@dataclass
class ResilienceConfig:
    max_restarts: int = 0
    """Restarts the elastic agent may spend on worker failures (also --max-restarts); each resumes from the newest
    complete checkpoint (snapshot tier or storage)."""
    nan_check: bool = True
    """Skip (and count) an update whose loss or gradient norm is NaN/Inf."""
    nan_rollback_after: int = 3
    """After this many non-finite steps in a row, roll back to the newest snapshot."""
    spike_zscore: float = 0.0
    """Loss-spike detection: a loss above the running mean by this many standard deviations rolls back to the newest
    snapshot from before the spike and skips the batches that caused it (PaLM). 0: off."""
    spike_window: int = 50
    """Steps in the running mean/std of the loss for spike detection."""
    hang_timeout_s: float = 0.0
    """Watchdog: a step taking longer than this writes every thread's stack and the last collective to the run
    directory and aborts, so the agent restarts the job. 0: off."""
    straggler_factor: float = 0.0
    """Name a rank whose busy time per step (its own work: CPU time on CPU, wall time on GPU) exceeds this multiple of
    the median (checked every straggler_interval steps), with its node; across two nodes or more, also a node whose
    link takes this multiple of the other nodes' median to send a 4 MiB probe. 0: off."""
    straggler_interval: int = 10
    """Steps between straggler checks (per-rank busy times are gathered then)."""
    sdc_interval: int = 0
    """Silent-data-corruption check every N steps (docs/resilience.md): each rank's parameter slices are
    fingerprinted (an exact sum of their bits) after the update and compared with the ranks that hold the same
    slice; slices with no replica (fsdp, zero2 shards; zero1 copies) are also compared with themselves before every
    update; with spike_zscore, a loss or grad-norm spike replays the step's forward on another rank. A difference
    writes sdc_detected (rank, step, what differed) and rolls back to the newest snapshot, whose steps are replayed.
    Needs snapshots at multiples of N (checkpoint.snapshot_interval or checkpoint.interval). 0: off."""
    sdc_exclude: bool = False
    """With sdc_interval: mark the host of a rank found corrupting data in <run.dir>/excluded_hosts.json; the
    launcher then starts (and restarts) no workers of this run on it."""
    inject: list[FaultConfig] = field(default_factory=list)
    """Fault injection for tests and drills, a list of tables, e.g. [{kind="kill", rank=1, step=5},
    {kind="nan", step=3}, {kind="slow", rank=1, factor=3}, {kind="write_error", step=6}]. Each fires once per job
    (not again after a restart)."""


@dataclass
class FaultToleranceConfig:
    """Replica groups that keep training when one of them fails (torchft; docs/resilience.md)."""

    enabled: bool = False
    """Split the --nproc workers into `replica_groups` data-parallel replicas coordinated by torchft: a group that
    loses a rank leaves the quorum, the others go on without it, and the group restarts, takes the weights and
    optimizer state from a live peer and rejoins at a step boundary. Needs the ft extra (pip install
    'scaletrain[ft]')."""
    replica_groups: int = 2
    """G: the number of replica groups; each is --nproc / G ranks (fsdp or ddp inside a group)."""
    min_replicas: int = 1
    """The fewest replica groups a step may commit with (the lighthouse's quorum size too)."""
    lighthouse: str = ""
    """The torchft lighthouse's address (http://host:port); empty: `scaletrain train --nproc N` starts one on
    loopback."""
    group: int = -1
    """The one replica group this command starts, when the groups run on different nodes: each node runs the same
    `scaletrain train --nproc N ...` with its own `group` and `address`, the same `lighthouse` and run directory
    (a shared filesystem), and starts N/G workers. -1: this command starts all G groups on this machine."""
    timeout_s: float = 30.0
    """How long a cross-group all-reduce, commit vote or heal transfer waits for a peer before the step is given
    up and run again. With three or more groups a survivor can wait this long in the step a group died in (one
    survivor gives up the collective at once, the other waits on it: 30.5 s measured at 30; issue 34)."""
    address: str = ""
    """This node's address on the cluster network, or a name that resolves to it (needed with `group`): the
    group's store, torchft's ManagerServer and its checkpoint server bind it, not every interface, and the other
    groups reach them there. Empty: 127.0.0.1 (every group on this machine)."""


@dataclass
class MetricsConfig:
    log_interval: int = 10
    """Write metrics every N steps (and on the last)."""
    tensorboard: bool = True
    """Also write TensorBoard event files under <run.dir>/tensorboard."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    peak_tflops: float = 0.0
    """Device peak for MFU in TFLOP/s per process; 0: look up the GPU, or measure the CPU once and cache it."""
    sample_prompt: str = ""
    """When set, `scaletrain train` ends with sample_count continuations of this prompt by the final checkpoint,
    one line each (`sample (seed S, temperature T, top-k K): PROMPT → TEXT`), also kept in <run.dir>/samples.jsonl
    for the report; `scaletrain generate RUN --prompt PROMPT --seed S` repeats one. Empty: no sample."""
    sample_temperature: float = 0.8
    """Softmax temperature of the samples, and `scaletrain generate`'s default; 0: greedy (one sample). Greedy
    decoding of a small model falls into one repeated token ('def ' → '____…', issue 39); 0.8 keeps its text
    readable."""
    sample_top_k: int = 40
    """Sample among the k likeliest tokens (the samples', and `scaletrain generate`'s default); 0: all."""
    sample_count: int = 3
    """How many samples, with seeds 0, 1, ... (greedy: one)."""
    report: bool = False
    """When true, `scaletrain train` ends by writing the run's report to <run.dir>/report (PNG plots and one HTML
    page, as the report command does) and printing `report: <run.dir>/report/index.html`."""
    wandb_project: str = ""
    """Also log metrics and events to this Weights & Biases project (needs `pip install wandb`; WANDB_MODE=offline
    keeps them on disk). Empty: off."""


@dataclass
class ProfileConfig:
    steps: str = ""
    """torch.profiler over these steps, "A-B" (inclusive) or "N": a Chrome/Perfetto trace and a summary (top ops,
    communication vs compute, overlap) in <run.dir>/profile/. Empty: off."""
    ranks: list[int] = field(default_factory=lambda: [0])
    """The ranks that profile (each writes its own rank{r}.trace.json)."""
    memory: bool = False
    """CUDA only: record the allocator's history on the profiled ranks from the start, dump a memory snapshot
    (rank{r}.memory.pickle, for pytorch.org/memory_viz) after the profiled steps and on out-of-memory."""


@dataclass
class RunConfig:
    dir: str = ""
    """Run directory (relative to the working directory, stored absolute). Empty: the newest runs/<name>-<date>-<time>
    that the same command trained (so the same command continues its run), else a new one. An existing run is
    continued from its newest intact checkpoint, never overwritten."""
    name: str = ""
    """Run name; empty: the config file's stem."""
    accept_changes: list[str] = field(default_factory=list)
    """On resume, config keys (or sections) whose change from the saved run is accepted, e.g. ["optimizer.lr",
    "training.steps"]. The model, tokenizer, data, seed and seq_len can never change within a run."""
    time_limit: str = ""
    """Wall time of this job, e.g. "3h50m", "90s", "2h" (from the job start: $SCALETRAIN_JOB_START, else the
    process start): stop with a committed checkpoint while one more step and the save still fit, and exit 75.
    Empty: no limit."""
    start_over: bool = False
    """Train this run again from step 0 although it holds no intact checkpoint (all rejected, or none saved); a
    run that does is otherwise refused. Rejected checkpoints stay, moved aside as checkpoints/rejected-step-N."""
    stop_at_step: int = 0
    """Stop at this step of the configured schedule (training.steps and the LR schedule unchanged) with a
    committed checkpoint, and exit 75; the same command without it continues the run. 0: off."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    run: RunConfig = field(default_factory=RunConfig)


def parse_batch_ramp(spec: str) -> tuple[int, int]:
    """(start sequences, ramp steps) of a `training.batch_ramp` string "start:steps"; ValueError saying what is
    wrong otherwise. (The checks against the batch and the layout are in data/ramp.py's ramp_problems.)"""
    parts = spec.split(":")
    try:
        start, steps = (int(p) for p in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        start = steps = None
    if start is None or steps is None:
        raise ValueError(
            f"training.batch_ramp '{spec}' is not of the form 'start:steps' (two whole numbers, e.g. '8:100': "
            "8 sequences at the first step, the full training.global_batch after 100 steps); leave it empty for none"
        )
    if start < 1 or steps < 1:
        raise ValueError(
            f"training.batch_ramp '{spec}': start and steps must both be >= 1 (start: the first step's global "
            "batch in sequences; steps: the ramp's length); leave it empty for no ramp"
        )
    return start, steps


# Keys that moved, old dotted name -> new: a run saved before the move resumes with its values under the new names
# (config/io.py with_defaults, RunDir.saved_config), and a config or override that still uses an old name is refused
# with the new one (config/io.py's unknown-key message).
RENAMED_KEYS: dict[str, str] = {
    "training.precision": "precision.compute",
    "training.mixed_precision": "precision.mechanism",
    "training.reduce_dtype": "precision.reduce_dtype",
    "training.fp8_recipe": "precision.fp8_recipe",
    "training.loss_scale_init": "precision.loss_scale_init",
    "training.loss_scale_growth_interval": "precision.loss_scale_growth_interval",
    "resilience.memory_interval": "checkpoint.snapshot_interval",
    "resilience.memory_max_mb": "checkpoint.snapshot_max_mb",
    "resilience.memory_ttl_hours": "checkpoint.snapshot_ttl_hours",
}


def translate_renamed(raw: dict) -> dict:
    """A copy of the nested config `raw` with every key of RENAMED_KEYS moved to its new name (a value already
    under the new name wins). What a run saved before a rename is read as."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for old, new in RENAMED_KEYS.items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        section = out.get(old_section)
        if not isinstance(section, dict) or old_key not in section:
            continue
        value = section.pop(old_key)
        target = out.setdefault(new_section, {})
        if isinstance(target, dict):
            target.setdefault(new_key, value)
    return out
