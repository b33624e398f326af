"""Cross-field checks of the whole config, run before any work starts: every problem, each with its fix; and
`load_config`, which parses a config (config_io) and validates it for a job of N ranks.

The model is checked as it will be built: the preset resolved with every model.* override (resolve_model_args),
so that a shape the attention cannot run is refused here, not at its first call.
"""

from __future__ import annotations

import difflib
import os
import tempfile
import uuid
from pathlib import Path

import fsspec
import torch

from scaletrain.checkpoint.hf import hf_dir_problems
from scaletrain.checkpoint.manager import has_committed_checkpoint
from scaletrain.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    MetricsConfig,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    ResilienceConfig,
    RunConfig,
    TrainingConfig,
)
from scaletrain.config_io import fields_typed, parse_config, resolve_paths, saved_config, to_dict
from scaletrain.data.sources import list_files
from scaletrain.data.tokenizer import load_tokenizer
from scaletrain.errors import ConfigError, UserError
from scaletrain.hardware import cuda_available, host_memory_bytes, uses_cuda
from scaletrain.metrics.profile import profile_problems
from scaletrain.metrics.writer import wandb_problem
from scaletrain.models.llama import ModelArgs
from scaletrain.models.moe import is_moe_layer
from scaletrain.models.presets import PRESETS, resolve_model_args
from scaletrain.optim import adamw_implementation
from scaletrain.parallel.layout import (
    Layout,
    attention_problems,
    batch_problems,
    comm_problems,
    rank_problems,
)
from scaletrain.parallel.offload import offload_problems
from scaletrain.planner.memory import (
    CPU_ESTIMATE_ERROR,
    CPU_OVERHEAD_BYTES,
    GPU_OVERHEAD_BYTES,
    memory_problem,
    per_rank_bytes,
)
from scaletrain.precision.policy import precision_problems
from scaletrain.precision.qat import qat_problems
from scaletrain.qk_clip import qk_clip_problems
from scaletrain.resilience import fault_tolerance
from scaletrain.resilience.faults import validate_specs
from scaletrain.resilience.timelimit import limit_problems
from scaletrain.resume import resume_problems
from scaletrain.rundir import RunDir


def load_config(
    path: str | None, overrides: list[str] | None = None, world_size: int = 1, check_run_dir: bool = True
) -> Config:
    """Read TOML, apply `--a.b value` overrides, type-check and validate; raise ConfigError listing every problem.

    Type problems stop before the cross-field checks: those need a config whose fields have their types. An
    unknown key does not: the rest of its section is read, so a misspelt key hides none of the other problems."""
    cfg, problems = parse_config(path, overrides or [])
    if fields_typed(problems):
        if not cfg.run.name and path:
            cfg.run.name = Path(path).stem
        resolve_paths(cfg)
        problems += validate(cfg, world_size, check_run_dir=check_run_dir)
    run = RunDir.at(cfg.run.dir) if cfg.run.dir else None
    if not problems and check_run_dir and run is not None and run.started():
        # A start in a run directory that trained continues that run: it must be the same run.
        problems += resume_problems(saved_config(run), to_dict(cfg), cfg.run.accept_changes)
    if problems:
        raise ConfigError(problems)
    return cfg


def check_configs(config: str | None, runs: list[tuple[str, list[str], int]]) -> None:
    """Validate the whole config of every run before the first starts: (name, its overrides of `config`, world
    size) each. A bad variant or layout is refused with every problem of every run at once, named by run, instead
    of after minutes of the runs before it."""
    problems = []
    for name, overrides, world in runs:
        try:
            load_config(config, overrides, world_size=world, check_run_dir=False)
        except ConfigError as e:
            problems += [f"{name}: {p}" for p in e.problems]
    if problems:
        raise ConfigError(problems)


def validate(cfg: Config, world_size: int, check_run_dir: bool = True) -> list[str]:
    """Every problem of the config for a job of `world_size` ranks; its Layout is resolved once, here."""
    # fault_tolerance: each replica group is a job of world_size / G ranks; the rest is checked per group.
    groups = cfg.fault_tolerance.replica_groups if cfg.fault_tolerance.enabled else 1
    layout = Layout.of(cfg, world_size // groups if groups >= 1 and world_size % groups == 0 else world_size)
    problems = _model(cfg.model)
    vocab = _tokenizer_vocab(cfg.data.tokenizer)
    # The shape checks need a known preset and sizes >= 1; _model reported what is wrong otherwise.
    args = (
        resolve_model_args(cfg.model, vocab, cfg.data.seq_len, moe=cfg.moe)
        if _resolvable(cfg.model)
        else None
    )
    if args is not None:
        problems += _model_shape(args, cfg.model, vocab)
        problems += _moe(cfg.moe, args, cfg.model.preset)
        if args.n_experts > 0 and cfg.training.compile:
            problems.append(
                "training.compile with MoE blocks is refused: the experts' data-dependent token splits break "
                "each compiled block into pieces, and compiled MoE has not been tested against eager; set "
                "training.compile = false"
            )
        problems += qat_problems(cfg.precision, args, tp=cfg.parallel.tp)
    problems += _data(cfg.data)
    problems += _training(cfg.training, layout)
    problems += _optimizer(cfg.optimizer)
    if cfg.optimizer.name == "muon" and cfg.memory.optimizer_offload:
        problems.append(
            "optimizer.name muon with memory.optimizer_offload is refused: the offloaded shards live on the host, "
            "and Muon gathers each whole matrix over the device mesh (NCCL sends device memory only), untested; "
            "set memory.optimizer_offload false, or use optimizer.name adamw"
        )
    problems += qk_clip_problems(cfg)
    if cfg.training.eval_interval > 0 and cfg.data.val_fraction == 0:
        problems.append(
            "training.eval_interval > 0 needs held-out data: set data.val_fraction > 0, or "
            "training.eval_interval 0"
        )
    problems += _metrics(cfg.metrics)
    if cfg.parallel.ddp_bucket_mb < 1:
        problems.append("parallel.ddp_bucket_mb must be >= 1")
    problems += comm_problems(layout)
    cuda = uses_cuda(cfg.training.device)
    problems += profile_problems(cfg.profile, cfg.training.steps, world_size, cuda)
    problems += _checkpoint(cfg.checkpoint)
    problems += _checkpoint_saving(cfg.checkpoint, check_storage=check_run_dir)
    # fault_tolerance: a replica group g > 0 started again heals from a live peer; it never reads the checkpoints.
    problems += _run(cfg.run, cfg.checkpoint, heals=cfg.fault_tolerance.group > 0) if check_run_dir else []
    problems += limit_problems(cfg.run, cfg.training.steps, cfg.checkpoint.enabled)
    problems += _resilience(cfg.resilience, world_size)
    problems += _sdc(cfg.resilience, cfg.checkpoint)
    problems += _sdc_layout(cfg)
    problems += fault_tolerance.problems(cfg, world_size)
    problems += _memory(cfg, layout)
    problems += _precision(cfg, layout)
    problems += _attention(cfg)
    # The layout and memory checks assume every field above is sound (and args resolved).
    if not problems and args is not None:
        problems += rank_problems(cfg, layout, args)
    if not problems and args is not None:
        problems += _fits_in_memory(cfg, layout, args)
    return problems


def _attention(cfg: Config) -> list[str]:
    """model.attention, model.window and data.document_mask against the device (and, in attention_problems, the
    parallel layout)."""
    m, problems = cfg.model, []
    if m.window < 0 or m.window_every < 1:
        problems.append(
            f"model.window must be >= 0 (0: off) and model.window_every >= 1, got {m.window} and {m.window_every}"
        )
    masked = cfg.data.document_mask or m.window > 0
    t = cfg.training
    cuda = uses_cuda(t.device)
    if m.attention in ("efficient", "cudnn", "flex") and not cuda:
        why = "FlexAttention has no backward on CPU" if m.attention == "flex" else "a CUDA-only SDPA kernel"
        problems.append(
            f"model.attention '{m.attention}' needs a CUDA device ({why}); on CPU use auto (masked SDPA when "
            "a mask is needed), flash (the CPU flash kernel) or math"
        )
    if m.attention == "flash" and cuda and masked:
        problems.append(
            "model.attention 'flash' takes no mask on CUDA, and data.document_mask or model.window needs one; "
            "use auto (FlexAttention) or efficient"
        )
    return problems + attention_problems(cfg)


def _memory(cfg: Config, layout: Layout) -> list[str]:
    """memory.*: recompute's k, and offload only where there is a separate device memory and (for the optimizer)
    FSDP to carry it."""
    m, problems = cfg.memory, []
    if m.recompute == "every_k" and m.recompute_every < 1:
        problems.append(
            f"memory.recompute_every must be >= 1 with recompute every_k, got {m.recompute_every}"
        )
    device = "cuda" if uses_cuda(cfg.training.device) else "cpu"
    return problems + offload_problems(m, device, cfg.parallel.data_parallel, layout.fsdp)


def _precision(cfg: Config, layout: Layout) -> list[str]:
    """precision.compute against the layout (where the FSDP2 policy can apply) and the device (fp8's hardware)."""
    device = "cuda" if uses_cuda(cfg.training.device) else "cpu"
    return precision_problems(cfg.precision, layout.fsdp, device, tp=cfg.parallel.tp)


def _metrics(m: MetricsConfig) -> list[str]:
    problems = [] if m.log_interval >= 1 else ["metrics.log_interval must be >= 1"]
    problems += [p for p in [wandb_problem(m.wandb_project)] if p]
    if not m.sample_temperature >= 0:
        problems.append(f"metrics.sample_temperature {m.sample_temperature} must be >= 0 (0: greedy)")
    if m.sample_top_k < 0:
        problems.append(f"metrics.sample_top_k {m.sample_top_k} must be >= 0 (0: the whole vocabulary)")
    if m.sample_count < 1:
        problems.append(
            f'metrics.sample_count {m.sample_count} must be >= 1 (no samples: metrics.sample_prompt "")'
        )
    return problems


def _resilience(r: ResilienceConfig, world_size: int) -> list[str]:
    problems = validate_specs(r.inject, world_size)
    if min(r.max_restarts, r.hang_timeout_s) < 0:
        problems.append("resilience.max_restarts and hang_timeout_s must be >= 0")
    if r.straggler_factor and r.straggler_factor <= 1:
        problems.append(
            "resilience.straggler_factor must be > 1 (a multiple of the median step time), or 0 (off)"
        )
    return problems


def _sdc(r: ResilienceConfig, c: CheckpointConfig) -> list[str]:
    """resilience.sdc_interval: a finding rolls back to the newest snapshot, which must hold verified weights: the
    periodic snapshots fall on check steps (each is taken after its step's check passed)."""
    n = r.sdc_interval
    if n < 0:
        return [f"resilience.sdc_interval must be >= 0 (0: off), got {n}"]
    if n == 0:
        return ["resilience.sdc_exclude needs resilience.sdc_interval > 0"] if r.sdc_exclude else []
    sources = [("checkpoint.snapshot_interval", c.snapshot_interval)]
    if c.enabled and isinstance(c.interval, int):
        sources.append(("checkpoint.interval", c.interval))
    on = [(key, v) for key, v in sources if v > 0]
    if not on:
        return [
            f"resilience.sdc_interval {n} needs a snapshot to roll back to: set checkpoint.snapshot_interval (the "
            f"memory tier) or checkpoint.interval to a multiple of {n}; without one a finding could only stop the "
            "run, the corrupted weights kept"
        ]
    return [
        f"{key} {v} must be a multiple of resilience.sdc_interval {n}: a snapshot between two checks could hold "
        "corrupted weights that a rollback would restore"
        for key, v in on
        if v % n
    ]


def _sdc_layout(cfg: Config) -> list[str]:
    """resilience.sdc_interval runs where it is tested (tests/e2e/test_sdc.py): one process and every data-parallel
    mode (ddp, zero1, zero2, fsdp, hsdp)."""
    p = cfg.parallel
    if cfg.resilience.sdc_interval <= 0:
        return []
    untested = [f"parallel.{k} {getattr(p, k)}" for k in ("tp", "pp", "cp", "ep") if getattr(p, k) > 1]
    if cfg.fault_tolerance.enabled:
        untested.append("fault_tolerance.enabled")
    if not untested:
        return []
    return [
        f"resilience.sdc_interval is tested with data parallelism only (ddp, zero1, zero2, fsdp, hsdp), not with "
        f"{', '.join(untested)}: use one of those layouts, or resilience.sdc_interval 0"
    ]


def _tokenizer_vocab(spec: str) -> int | None:
    """The tokenizer's vocabulary, or None when it does not load (_data reports why)."""
    try:
        return load_tokenizer(spec).vocab_size
    except UserError:
        return None


def _checkpoint(c: CheckpointConfig) -> list[str]:
    problems = []
    if isinstance(c.interval, int) and c.interval < 0:
        problems.append("checkpoint.interval must be >= 0 (0: only at the end and on SIGTERM) or 'auto'")
    if c.keep_last < 0 or c.keep_every < 0:
        problems.append("checkpoint.keep_last and checkpoint.keep_every must be >= 0")
    if c.mtbf_hours <= 0:
        problems.append("checkpoint.mtbf_hours must be > 0")
    if min(c.snapshot_interval, c.snapshot_ttl_hours) < 0:
        problems.append("checkpoint.snapshot_interval and checkpoint.snapshot_ttl_hours must be >= 0")
    return problems


def _checkpoint_saving(c: CheckpointConfig, check_storage: bool) -> list[str]:
    """checkpoint.interval_minutes, and whether checkpoint.storage takes a file (checked where the run directory
    is: by the launcher, or the first rank of a first attempt). An unwritable storage used to be found at the final
    save, after all the training."""
    problems = []
    if not c.interval_minutes >= 0:
        problems.append("checkpoint.interval_minutes must be >= 0 (0: no time bound between saves)")
    if check_storage and c.enabled and c.storage:
        problems += [p for p in [storage_write_problem(c.storage)] if p]
    return problems


def storage_write_problem(location: str) -> str | None:
    """Why a file cannot be written at a checkpoint storage root (a local path or an fsspec URL), else None. A probe
    file is written and removed; a local root that does not exist yet is checked where it would be created."""
    fix = "fix its permissions (or credentials), or choose another --checkpoint.storage (empty: <run.dir>/checkpoints)"
    try:
        if "://" in location:
            fs, root = fsspec.core.url_to_fs(location)
            fs.makedirs(root, exist_ok=True)
            probe = f"{root.rstrip('/')}/.scaletrain-write-probe-{uuid.uuid4().hex}"
            fs.pipe_file(probe, b"probe")
            fs.rm(probe)
            return None
        ancestor = Path(location)
        while not ancestor.exists():
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            return f"checkpoint.storage '{location}' cannot be created: '{ancestor}' is a file; {fix}"
        with tempfile.TemporaryFile(dir=ancestor) as f:
            f.write(b"probe")
            f.flush()
    except Exception as e:  # fsspec backends raise their own (PermissionError, botocore's ClientError, ...)
        return f"checkpoint.storage '{location}' is not writable ({type(e).__name__}: {e}); {fix}"
    return None


_SIZE_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_hidden",
    "vocab_size",
    "rope_original_max_len",
)


def _resolvable(m: ModelConfig) -> bool:
    return m.preset in PRESETS and all(getattr(m, n) is None or getattr(m, n) >= 1 for n in _SIZE_FIELDS)


def _model(m: ModelConfig) -> list[str]:
    """The model.* fields on their own; the shape they resolve to is checked by _model_shape."""
    if m.preset not in PRESETS:
        near = difflib.get_close_matches(m.preset, list(PRESETS), n=1, cutoff=0.3)
        hint = f" (did you mean '{near[0]}'?)" if near else ""
        return [f"model.preset '{m.preset}' is unknown{hint}; choose one of {', '.join(PRESETS)}"]
    problems = [
        f"model.{name} must be >= 1, got {getattr(m, name)}"
        for name in _SIZE_FIELDS
        if getattr(m, name) is not None and getattr(m, name) < 1
    ]
    for name in ("rope_theta", "rope_scaling_factor", "norm_eps", "init_std"):
        v = getattr(m, name)
        if v is not None and v <= 0:
            problems.append(f"model.{name} must be > 0, got {v}")
    if m.init_from:
        hf = Path(m.init_from[3:])
        if not m.init_from.startswith("hf:"):
            problems.append(
                f"model.init_from '{m.init_from}' is not understood; write hf:DIR for a Hugging Face "
                "Llama directory"
            )
        elif not (hf / "config.json").is_file() or not any(hf.glob("*.safetensors")):
            problems.append(
                f"model.init_from: '{hf}' needs config.json and .safetensors weights (pickle files are "
                "never loaded)"
            )
        else:
            problems += hf_dir_problems(hf)  # before launch, not at the first rank's build
    return problems


def _model_shape(args: ModelArgs, m: ModelConfig, tokenizer_vocab: int | None) -> list[str]:
    """The resolved shape against what attention, RoPE and the embedding need; each message names the field to
    change and says when its value came from the preset rather than from the config."""

    def field(name: str) -> str:
        origin = "" if getattr(m, name) is not None else f" (from model.preset '{m.preset}')"
        return f"model.{name} {getattr(args, name)}{origin}"

    problems = []
    dim, heads, kv = args.dim, args.n_heads, args.n_kv_heads
    if dim % heads:
        problems.append(
            f"{field('dim')} is not divisible by {field('n_heads')}: each head gets dim / n_heads channels; "
            f"set model.n_heads to one of {_divisors_near(dim, heads, even_quotient=True)} or change model.dim"
        )
    elif (dim // heads) % 2:
        problems.append(
            f"the head size {field('dim')} / {field('n_heads')} = {dim // heads} is odd, and RoPE rotates "
            f"pairs of channels; set model.n_heads to one of {_divisors_near(dim, heads, even_quotient=True)}"
        )
    if heads % kv:
        problems.append(
            f"{field('n_heads')} is not divisible by {field('n_kv_heads')} (grouped-query attention shares each "
            f"key/value head among n_heads / n_kv_heads query heads); set model.n_kv_heads to one of "
            f"{_divisors_near(heads, kv)}"
        )
    if tokenizer_vocab is not None and args.vocab_size < tokenizer_vocab:
        problems.append(
            f"{field('vocab_size')} is smaller than the tokenizer's {tokenizer_vocab} tokens, so some token ids "
            f"have no embedding row; set model.vocab_size >= {tokenizer_vocab}, or leave it unset with a preset "
            "that takes the tokenizer's (debug)"
        )
    return problems


_MOE_SHAPE = ("top_k", "hidden", "shared_experts", "router", "norm_topk", "every", "first_dense")


def _moe(moe: MoEConfig, args: ModelArgs, preset: str) -> list[str]:
    """The MoE shape as resolved (moe.* over the preset) and the MoE training knobs."""

    def field(name: str, value: object) -> str:
        origin = "" if getattr(moe, name) is not None else f" (from model.preset '{preset}')"
        return f"moe.{name} {value}{origin}"

    problems = [
        f"moe.{name} must be >= 0, got {getattr(moe, name)}"
        for name in ("capacity_factor", "aux_loss_coef", "z_loss_coef", "bias_update_rate")
        if getattr(moe, name) < 0
    ]
    e, k = args.n_experts, args.top_k
    if e < 0:
        return problems + [f"moe.n_experts must be >= 0 (0: a dense model), got {e}"]
    if e == 0:
        # Refused rather than ignored: a knob that silently does nothing hides a typo'd preset or a lost line.
        unused = [f"moe.{n}" for n in _MOE_SHAPE if getattr(moe, n) is not None]
        unused += ["moe.capacity_factor"] if moe.capacity_factor > 0 else []
        unused += ["moe.bias_update_rate"] if moe.bias_update_rate > 0 else []
        if unused:
            one = len(unused) == 1
            presets = ", ".join(p for p in PRESETS if p != "debug" and PRESETS[p].get("n_experts"))
            problems.append(
                f"{', '.join(unused)} {'is' if one else 'are'} set, but the model is dense "
                f"({field('n_experts', 0)}), so {'it has' if one else 'they have'} no effect; set "
                f"moe.n_experts > 0 or a MoE preset ({presets}), or remove {'it' if one else 'them'}"
            )
        return problems
    if k < 1 or k > e:
        problems.append(
            f"{field('top_k', k)} must be between 1 and {field('n_experts', e)}: each token goes to top_k "
            f"distinct experts; set moe.top_k to at most {e}"
        )
    for name, value in (("hidden", args.moe_hidden), ("every", args.moe_every)):
        if value < 1 and getattr(moe, name) is not None:
            problems.append(f"{field(name, value)} must be >= 1")
    for name, value in (("shared_experts", args.shared_experts), ("first_dense", args.first_dense)):
        if value < 0:
            problems.append(f"{field(name, value)} must be >= 0")
    if args.moe_every >= 1 and not any(is_moe_layer(args, i) for i in range(args.n_layers)):
        problems.append(
            f"no block is MoE: {field('first_dense', args.first_dense)} and {field('every', args.moe_every)} "
            f"leave all {args.n_layers} blocks dense; lower moe.first_dense or moe.every, or set moe.n_experts 0"
        )
    return problems


def _divisors_near(n: int, near: int, even_quotient: bool = False) -> str:
    """Up to three divisors of `n` closest to `near` (with `even_quotient`: only those d with n / d even), for a
    message that suggests values that work."""
    ok = [d for d in range(1, n + 1) if n % d == 0 and (not even_quotient or (n // d) % 2 == 0)]
    return ", ".join(map(str, sorted(sorted(ok, key=lambda d: (abs(d - near), d))[:3]))) or "none"


def _data(d: DataConfig) -> list[str]:
    problems = []
    if d.seq_len < 2:
        problems.append(f"data.seq_len must be >= 2, got {d.seq_len}")
    if not 0 <= d.val_fraction < 1:
        problems.append(f"data.val_fraction must be in [0, 1), got {d.val_fraction}")
    if d.workers < 0:
        problems.append("data.workers must be >= 0 (0 = one per core)")
    for i, src in enumerate(d.sources):
        if src.weight <= 0:
            problems.append(f"data.sources[{i}].weight must be > 0, got {src.weight}")
        if not src.path:
            problems.append(f"data.sources[{i}].path is empty; give a file, a directory or a glob")
            continue
        try:
            list_files(src, i)
        except UserError as e:
            problems.append(str(e))
    try:
        load_tokenizer(d.tokenizer)
    except UserError as e:
        problems.append(str(e))
    return problems


def _training(t: TrainingConfig, layout: Layout) -> list[str]:
    problems = []
    if t.steps < 1:
        problems.append(f"training.steps must be >= 1, got {t.steps}")
    problems += batch_problems(t, layout)  # with training.batch_ramp's (data/ramp.py)
    if t.grad_clip < 0:
        problems.append("training.grad_clip must be >= 0 (0 disables clipping)")
    if t.eval_interval < 0 or t.eval_sequences < 1:
        problems.append("training.eval_interval must be >= 0 and training.eval_sequences >= 1")
    if t.threads < 0:
        problems.append("training.threads must be >= 0 (0 = cores / local processes)")
    if t.device == "cuda" and not cuda_available():
        problems.append("training.device is 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    return problems


def _optimizer(o: OptimizerConfig) -> list[str]:
    problems = []
    if o.lr <= 0:
        problems.append(f"optimizer.lr must be > 0, got {o.lr}")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        problems.append(f"optimizer.betas must be two numbers in [0, 1), got {o.betas}")
    if o.eps <= 0 or o.weight_decay < 0:
        problems.append("optimizer.eps must be > 0 and optimizer.weight_decay >= 0")
    if o.warmup_steps < 0:
        problems.append("optimizer.warmup_steps must be >= 0")
    if not 0 <= o.min_lr_ratio <= 1:
        problems.append(f"optimizer.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    if not 0 < o.decay_fraction <= 1:
        problems.append(f"optimizer.decay_fraction must be in (0, 1], got {o.decay_fraction}")
    if o.muon_lr is not None and o.muon_lr <= 0:
        problems.append(f"optimizer.muon_lr must be > 0 (or unset: optimizer.lr), got {o.muon_lr}")
    if o.muon_weight_decay is not None and o.muon_weight_decay < 0:
        problems.append(f"optimizer.muon_weight_decay must be >= 0, got {o.muon_weight_decay}")
    if not 0 <= o.muon_momentum < 1:
        problems.append(f"optimizer.muon_momentum must be in [0, 1), got {o.muon_momentum}")
    if not 1 <= o.muon_ns_steps < 100:
        problems.append(f"optimizer.muon_ns_steps must be in [1, 99], got {o.muon_ns_steps}")
    return problems


def _run(r: RunConfig, c: CheckpointConfig, heals: bool = False) -> list[str]:
    if not r.dir:
        return []
    run = RunDir.at(r.dir)
    path = run.path
    # A run counts once it started training: a start that failed before (bad data, say) blocks nothing.
    if run.started() and not r.start_over and not heals:
        saved = c.enabled and run.run_id() is not None and has_committed_checkpoint(run.checkpoint_root(c))
        if not saved and c.snapshot_interval == 0:
            return [
                f"run.dir '{r.dir}' already holds a run that trained but has no committed checkpoint to continue from; it "
                "is never overwritten: choose a new --run.dir, or add --run.start_over true to train it again "
                "from step 0 (its records are kept)"
            ]
    if path.exists() and not path.is_dir():
        return [f"run.dir '{r.dir}' is a file, not a directory; choose another --run.dir"]
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return [f"run.dir '{r.dir}' cannot be created: '{ancestor}' is a file; choose another --run.dir"]
    try:
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as e:
        return [f"run.dir '{r.dir}' is not writable ({e.strerror} in '{ancestor}'); choose another --run.dir"]
    return []


def memory_estimate(cfg: Config, world_size: int) -> dict[str, float]:
    """The estimate _fits_in_memory holds against this host or GPU: per_rank_bytes of the fullest rank, by part,
    with the CPU's per-process terms where the workers run on this host (benchmarks/memory_matrix.py compares it
    with the kernel's figures)."""
    layout = Layout.of(cfg, world_size)
    args = resolve_model_args(cfg.model, _tokenizer_vocab(cfg.data.tokenizer), cfg.data.seq_len, moe=cfg.moe)
    _, _, overhead = _device_memory(cfg, world_size)
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
    )


def _fits_in_memory(cfg: Config, layout: Layout, args: ModelArgs) -> list[str]:
    """Refuse a layout whose fullest rank cannot hold its share of the model (ZeRO sharding, tp and pp splits),
    its activations at the configured micro-batch and the logits, instead of dying in the allocator minutes later;
    the message says by how much and which knob would fit (the estimate: planner.memory.per_rank_bytes)."""
    have, where, overhead = _device_memory(cfg, layout.world_size)
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
        error=0.0 if where == "GPU" else CPU_ESTIMATE_ERROR,  # measured on a CPU host only
    )
    return [f"model.preset '{cfg.model.preset}': {problem}"] if problem else []


def _foreach_step(cfg: Config) -> bool:
    """AdamW steps with its foreach kernels (what the memory check counts for the step: step_transient_bytes)."""
    device = "cuda" if uses_cuda(cfg.training.device) else "cpu"
    return adamw_implementation(cfg.optimizer.implementation, device) == "foreach"


def _device_memory(cfg: Config, world_size: int) -> tuple[int, str, int]:
    """(bytes one process may use, what they are, the framework overhead to count): a GPU's total memory, or on
    CPU this process's share of the host memory (the node's processes share it)."""
    cuda = uses_cuda(cfg.training.device)
    if cuda:
        return torch.cuda.get_device_properties(0).total_memory, "GPU", GPU_OVERHEAD_BYTES
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    # Before launch, what the host has free now; a worker, whose peers already hold their share, checks against
    # the physical memory (its launcher made the first check).
    host = host_memory_bytes(worker="LOCAL_RANK" in os.environ)
    return host // max(local, 1), "host memory share", CPU_OVERHEAD_BYTES
