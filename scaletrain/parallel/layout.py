"""The job's layout, resolved once from (config, world size): the mesh sizes and the batch arithmetic (global batch,
per-rank batch, micro-batches) in one frozen `Layout`, and every rule a layout must satisfy (`layout_problems`).
Validation, the planner and job.build take a Layout; none of them recomputes these numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass

from scaletrain.config import Config, ParallelConfig, TrainingConfig
from scaletrain.data.ramp import ramp_problems
from scaletrain.errors import ConfigError
from scaletrain.models.llama import ModelArgs
from scaletrain.parallel.mesh import FLAT_DIMS, ParallelDims, resolve_dp_shard, tiling_problems
from scaletrain.parallel.pipeline import SPLIT_BACKWARD, pipeline_problems


def global_batch_sequences(t: TrainingConfig, seq_len: int) -> int:
    """The global batch in sequences, whichever way it was given."""
    return t.global_batch_tokens // seq_len if t.global_batch_tokens > 0 else t.global_batch


def resolve_microbatches(pp_microbatches: int, local_batch: int, micro_batch: int) -> int:
    """`parallel.pp_microbatches`, where 0 means one per `training.micro_batch` sequences of the local batch."""
    return pp_microbatches if pp_microbatches > 0 else max(1, local_batch // micro_batch)


@dataclass(frozen=True)
class Layout:
    """The mesh sizes (dp_shard resolved) and the batch of one job on `world_size` ranks. Sizes that do not tile
    the world are kept with their `size_problems` (validation reports them); the batch then splits over the whole
    world, so that the other checks can still run."""

    parallel: ParallelConfig
    world_size: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    seq_len: int
    global_batch: int  # sequences per optimizer step, over all data-parallel ranks
    micro_batch: int  # sequences per forward/backward on one rank
    size_problems: tuple[str, ...] = ()

    @classmethod
    def of(cls, cfg: Config, world_size: int) -> Layout:
        return cls.resolve(cfg.parallel, cfg.training, cfg.data.seq_len, world_size)

    @classmethod
    def resolve(cls, p: ParallelConfig, t: TrainingConfig, seq_len: int, world_size: int) -> Layout:
        """The layout of one section triple: what Layout.of reads, and what the planner builds per candidate."""
        problems = tuple(tiling_problems(p, world_size))
        dp_shard = resolve_dp_shard(p, world_size)
        gb = global_batch_sequences(t, max(seq_len, 1))
        return cls(p, world_size, p.dp_replicate, dp_shard, p.cp, p.tp, p.pp, p.ep, seq_len, gb, t.micro_batch,
                   problems)  # fmt: skip

    @property
    def tiles(self) -> bool:
        return not self.size_problems

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each reads a different slice of the global batch."""
        return self.dp_replicate * self.dp_shard if self.tiles else self.world_size

    @property
    def local_batch(self) -> int:
        """Sequences per data-parallel rank per step."""
        return self.global_batch // max(self.dp_size, 1)

    @property
    def microbatches(self) -> int:
        """Micro-batches per rank per step: the pipeline's (pp > 1), else the gradient-accumulation steps."""
        return resolve_microbatches(self.parallel.pp_microbatches, self.local_batch, max(self.micro_batch, 1))

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def size(self, name: str) -> int:
        """Size of a mesh dim or a flattened one ("dp", "dp_shard_cp", "dp_cp"), or of "ep" and "dp_mod_ep"."""
        if name == "dp_mod_ep":
            return self.dp_shard // self.ep
        return math.prod(getattr(self, d) for d in FLAT_DIMS.get(name, (name,)))

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 wraps the model (fsdp_applies); a layout whose sizes do not tile counts as FSDP (the
        tiling is reported, and the checks that ask this one stay quiet)."""
        return not self.tiles or fsdp_applies(self, self.parallel.data_parallel)

    def checked(self) -> Layout:
        """This layout; ConfigError where its sizes do not tile the world."""
        if not self.tiles:
            raise ConfigError(list(self.size_problems))
        return self

    def dims(self) -> ParallelDims:
        """The ParallelDims of these sizes, to build the mesh from (ConfigError where they do not tile)."""
        self.checked()
        return ParallelDims(self.dp_replicate, self.dp_shard, self.cp, self.tp, self.pp, self.ep)


def fsdp_applies(dims: ParallelDims | Layout, mode: str) -> bool:
    """Whether the layout wraps the model in FSDP2: hsdp always, fsdp and zero2 over more than one dp_shard x cp
    rank (on one rank there is nothing to shard)."""
    return mode == "hsdp" or (mode in ("fsdp", "zero2") and dims.size("dp_shard_cp") > 1)


def updates_each_replica(mode: str) -> bool:
    """Whether every rank that holds a copy of a parameter also computes its update (ddp, hsdp, the shards of
    fsdp/zero2), or one rank updates it and sends the result to the others (zero1: a copy that changes between two
    updates is overwritten at the next, so the replicas agree again and only a watch at rest sees it)."""
    return mode != "zero1"


def layout_problems(cfg: Config, layout: Layout, args: ModelArgs) -> list[str]:
    """Every rule of the layout at once: the batch split, attention under cp/pp, sizes that tile the world, tp/cp
    divisibility, expert parallel and the pipeline's micro-batch rules; what the planner's search asks of each
    candidate (validate checks the same rules, each where its message belongs)."""
    return (
        batch_problems(cfg.training, layout)
        + attention_problems(cfg, args)
        + rank_problems(cfg, layout, args)
    )


def batch_problems(t: TrainingConfig, layout: Layout) -> list[str]:
    """The global batch splits into whole sequences and into micro_batch x data-parallel ranks, and so does the batch
    ramp's first step (training.batch_ramp; the planner's candidates are held to it too)."""
    if t.micro_batch < 1:
        return [f"training.micro_batch must be >= 1, got {t.micro_batch}"]
    problems, seq_len = [], layout.seq_len
    if t.global_batch_tokens > 0 and seq_len >= 2 and t.global_batch_tokens % seq_len:
        problems.append(
            f"training.global_batch_tokens {t.global_batch_tokens} is not a multiple of data.seq_len "
            f"{seq_len}; use {max(1, t.global_batch_tokens // seq_len) * seq_len}"
        )
    gb, dp_size = layout.global_batch, layout.dp_size
    per_step = t.micro_batch * dp_size
    if gb < 1 or gb % per_step:
        fix = max(1, round(gb / per_step)) * per_step
        problems.append(
            f"the global batch of {gb} sequences is not divisible by training.micro_batch "
            f"{t.micro_batch} x {dp_size} data-parallel ranks; use training.global_batch {fix}, "
            f"or change training.micro_batch"
        )
    return problems + ramp_problems(t.batch_ramp, gb, t.steps, t.micro_batch, dp_size, layout.pp)


def attention_problems(cfg: Config, args: ModelArgs) -> list[str]:
    """Attention masks and kernels that a split sequence (cp) or a pipeline stage (pp) cannot take (the window and
    the sinks as the model resolves them: a preset may set them)."""
    m, p, problems = cfg.model, cfg.parallel, []
    masked = cfg.data.document_mask or args.window > 0
    if p.cp > 1 and args.attention_sinks:
        problems.append(
            "model.attention_sinks (GPT-OSS) is not supported with parallel.cp > 1: ring attention has no sink term "
            "in its softmax; set parallel.cp = 1"
        )
    if p.cp > 1:
        # Ring attention masks blocks by position only; skipping fully masked blocks is future work.
        if masked:
            problems.append(
                "data.document_mask and model.window are not supported with parallel.cp > 1: ring attention is "
                "causal-only; turn them off or set parallel.cp = 1"
            )
        if m.attention != "auto":
            problems.append(
                f"model.attention '{m.attention}' has no effect with parallel.cp > 1 (ring attention runs its "
                "own kernel); leave it auto"
            )
    if p.pp > 1 and cfg.data.document_mask:
        problems.append(
            "data.document_mask is not supported with parallel.pp > 1: the schedule calls later stages with "
            "hidden states only, so the document ids cannot reach them; set parallel.pp = 1 or turn it off "
            "(model.window works under pp)"
        )
    return problems


def rank_problems(cfg: Config, layout: Layout, args: ModelArgs) -> list[str]:
    """How the model and its sequences split over the ranks: sizes that tile the world, divisibility for tp/cp,
    expert parallel, the pipeline's micro-batch rules."""
    p, seq_len = cfg.parallel, cfg.data.seq_len
    problems = validate_parallel(
        p,
        layout.world_size,
        args.n_heads,
        args.n_kv_heads,
        args.vocab_size,
        ffn_hidden=args.ffn_hidden,
        seq_len=seq_len,
        tie_embeddings=args.tie_embeddings,
        n_experts=args.n_experts,
    )
    if p.cp > 1:
        chunks = 2 * p.cp if p.cp_load_balance else p.cp
        if seq_len % chunks:
            problems.append(
                f"data.seq_len {seq_len} must be a multiple of {chunks} for cp = {p.cp} "
                f"({'zig-zag: 2 chunks per rank' if p.cp_load_balance else 'one chunk per rank'}); "
                f"use {max(1, round(seq_len / chunks)) * chunks}"
            )
    if p.pp > 1:
        problems += pipeline_problems(
            p.pp_schedule,
            p.pp,
            p.pp_virtual_stages,
            layout.microbatches,
            n_layers=args.n_layers,
            local_batch=layout.local_batch,
            tie_embeddings=args.tie_embeddings,
            data_parallel=p.data_parallel,
            dp=layout.dp_size * p.cp,
        )
    if args.mla and (p.tp > 1 or p.cp > 1):
        problems.append(
            "multi-head latent attention (model.kv_lora_rank > 0) is not supported with parallel.tp > 1 or cp > 1: "
            "the tensor-parallel plan splits wq/wk/wv by heads, where MLA has latent projections (wq_a, wkv_a) "
            "that no head split divides, and ring attention takes one head size for keys and values (MLA's "
            "differ); neither is trained against the single process, so set parallel.tp = 1 and parallel.cp = 1 "
            "(fsdp, ep and pp are: tests/distributed/test_deepseek_v3.py)"
        )
    if args.mtp_depth and (p.pp > 1 or p.ep > 1 or p.tp > 1 or p.cp > 1):
        problems.append(
            "model.mtp_depth > 0 is not supported with parallel.pp, ep, tp or cp > 1: the MTP module sits beside "
            "the output on no pipeline stage, outside the blocks that expert and tensor parallel split, and "
            "takes whole sequences; it is trained against the single process under fsdp "
            "(tests/distributed/test_deepseek_v3.py); set those to 1 or model.mtp_depth = 0"
        )
    return problems


def validate_parallel(
    pcfg: ParallelConfig,
    world_size: int,
    n_heads: int,
    n_kv_heads: int,
    vocab_size: int,
    *,
    ffn_hidden: int | None = None,
    seq_len: int | None = None,
    tie_embeddings: bool = False,
    n_experts: int = 0,
) -> list[str]:
    """Every problem of the parallel layout at once, each with its fix; [] when the layout runs (n_experts 0: dense)."""
    problems = tiling_problems(pcfg, world_size)
    problems += [] if problems else _moe_problems(pcfg, resolve_dp_shard(pcfg, world_size), n_experts)
    mode = pcfg.data_parallel
    if pcfg.dp_replicate > 1 and mode != "hsdp":
        problems.append(
            f"parallel.dp_replicate = {pcfg.dp_replicate} needs parallel.data_parallel = 'hsdp' "
            f"(replicate across groups, shard within); with '{mode}' set dp_replicate = 1"
        )
    if mode == "hsdp" and pcfg.dp_replicate == 1:
        problems.append(
            "parallel.data_parallel = 'hsdp' with dp_replicate = 1 is plain sharding: use "
            "data_parallel = 'fsdp', or set dp_replicate > 1"
        )
    tp = pcfg.tp
    dp_cp = pcfg.dp_replicate * resolve_dp_shard(pcfg, world_size) * pcfg.cp
    if tp > 1 and mode in ("ddp", "zero1") and dp_cp > 1:
        # With no data-parallel ranks (dp_cp = 1) no DDP is applied, so pure TP runs whatever the mode says.
        problems.append(
            f"parallel.data_parallel = '{mode}' cannot be combined with tp = {tp} over {dp_cp} "
            "data-parallel ranks: DDP does not handle the DTensor parameters that tensor parallel "
            "creates; use data_parallel = 'fsdp' or 'zero2' with tp"
        )
    if tp > 1:
        divisible = [
            ("model.n_heads", n_heads, "attention is split by whole query heads"),
            (
                "model.n_kv_heads",
                n_kv_heads,
                "each rank needs whole key/value heads for its share of query heads",
            ),
            (
                "the vocabulary size",
                vocab_size,
                "the embedding and the output layer are split by vocabulary rows",
            ),
            (
                "model.ffn_hidden",
                ffn_hidden,
                "the MLP is split along its hidden size (w1/w3 columns, w2 rows)",
            ),
        ]
        if pcfg.sequence_parallel and seq_len is not None and pcfg.cp >= 1 and seq_len % pcfg.cp == 0:
            what = (
                "data.seq_len"
                if pcfg.cp == 1
                else f"the {seq_len // pcfg.cp} tokens per cp rank of data.seq_len"
            )
            divisible.append(
                (what, seq_len // pcfg.cp, "sequence parallel splits every sequence over the tp ranks")
            )
        for what, n, why in divisible:
            if n is not None and n % tp:
                problems.append(
                    f"parallel.tp = {tp} does not divide {what} {n} ({why}); choose a tp that divides it"
                )
    if tp > 1 and tie_embeddings:
        problems.append(
            "tensor parallel splits the embedding by vocabulary rows and the output layer by vocabulary "
            "columns, so one tied matrix cannot serve both; set model.tie_embeddings = false or tp = 1"
        )
    if pcfg.sequence_parallel and tp == 1:
        problems.append(
            "parallel.sequence_parallel splits the norms' activations over the tensor-parallel ranks and "
            "needs tp > 1; set parallel.tp > 1 or sequence_parallel = false"
        )
    return problems


def _moe_problems(pcfg: ParallelConfig, dp_shard: int, n_experts: int) -> list[str]:
    """Expert parallel and the layouts a MoE model trains equivalently in (tested in
    tests/distributed/test_expert_parallel.py); the others are refused, each with its reason."""
    problems, ep = [], pcfg.ep
    if n_experts > 0 and pcfg.cp > 1:
        problems.append(
            f"a MoE model cannot use parallel.cp = {pcfg.cp}: its balance loss and expert capacity are computed "
            "per whole sequence, and context parallel splits every sequence over ranks; set parallel.cp = 1"
        )
    if ep == 1:
        return problems
    if n_experts == 0:
        problems.append(
            f"parallel.ep = {ep} splits the experts of a MoE model, but this model is dense (n_experts = 0); "
            "set parallel.ep = 1 or moe.n_experts > 0"
        )
    elif n_experts % ep:
        problems.append(
            f"parallel.ep = {ep} must divide moe.n_experts {n_experts} (each rank holds the same number of "
            "whole experts); choose an ep that divides it"
        )
    if dp_shard % ep:
        problems.append(
            f"parallel.ep = {ep} is carved from dp_shard and must divide it, but dp_shard = {dp_shard}; "
            "choose an ep that divides dp_shard (or more processes)"
        )
    if pcfg.data_parallel != "fsdp":
        problems.append(
            f"parallel.ep = {ep} needs parallel.data_parallel = 'fsdp' (the experts are sharded over the "
            f"ranks that hold the same experts, the dense weights over all dp_shard ranks); "
            f"'{pcfg.data_parallel}' is not supported with expert parallel"
        )
    return problems


def comm_problems(layout: Layout) -> list[str]:
    """parallel.grad_compression, powersgd_*, fsdp_prefetch and reshard_after_forward against the layout."""
    p, problems = layout.parallel, []
    if p.grad_compression != "none":
        if p.data_parallel not in ("ddp", "zero1"):
            problems.append(
                f"parallel.grad_compression '{p.grad_compression}' is a DDP communication hook (ddp, zero1); "
                f"{p.data_parallel} reduces its gradients through FSDP2: set precision.reduce_dtype = 'bf16' to "
                "halve that traffic, or parallel.grad_compression = 'none'"
            )
        elif max(p.tp, p.pp, p.cp) > 1:
            problems.append(
                f"parallel.grad_compression '{p.grad_compression}' is tested with plain data parallelism only "
                "(tp = pp = cp = 1); set it to 'none' for this layout"
            )
    if p.powersgd_rank < 1 or p.powersgd_start_iter < 2:
        problems.append(
            "parallel.powersgd_rank must be >= 1 and parallel.powersgd_start_iter >= 2 (DDP settles its gradient "
            f"buckets in the first step, and the error feedback needs them fixed), got {p.powersgd_rank} and "
            f"{p.powersgd_start_iter}"
        )
    if p.fsdp_prefetch < 0:
        problems.append(f"parallel.fsdp_prefetch must be >= 0 (0: FSDP2's default), got {p.fsdp_prefetch}")
    choice = p.reshard_after_forward
    if choice == "auto":
        return problems
    where = "parallel.reshard_after_forward"
    if p.data_parallel not in ("fsdp", "zero2", "hsdp"):
        return [
            *problems,
            f"{where} applies to fsdp, zero2 and hsdp only; leave it 'auto' with {p.data_parallel}",
        ]
    if choice is not False and p.data_parallel == "zero2":
        return [*problems, f"{where} = {choice}: zero2 keeps the gathered parameters by definition; use fsdp"]
    if choice is not False and p.pp > 1 and p.pp_schedule in SPLIT_BACKWARD:
        return [
            *problems,
            f"{where} = {choice} with the zero-bubble schedule {p.pp_schedule}: resharding between a micro-"
            "batch's input- and weight-gradient passes trains a different model in torch 2.13 (see "
            "parallel/pipeline.py reshards_after_forward); leave it 'auto'",
        ]
    if not isinstance(choice, bool):
        if not layout.tiles:
            return problems  # the layout check reports sizes that do not tile the world
        shard = layout.size("dp_shard_cp")
        if choice < 2 or choice >= shard or shard % choice:
            problems.append(
                f"{where} = {choice}: an int must divide the {shard} ranks each parameter is sharded over and lie "
                "strictly between 1 and that (FSDP2 reshards to a mesh of that size); or use true or false"
            )
    return problems
