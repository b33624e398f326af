"""Every problem of the config at once, each with its fix, before any work starts: `validate` composes the checks
that each package owns for its own section (models: model.* and moe.*; data; optim; parallel: the layout, memory;
precision; checkpoint; metrics; resilience; planning.estimators: whether the layout fits in memory) with the few
rules across sections kept here; and `load_config`, which parses a config (config/io.py) and validates it for a job
of N ranks.

The model is checked as it will be built: the preset resolved with every model.* override (resolve_model_args),
so that a shape the attention cannot run is refused here, not at its first call.
"""

from __future__ import annotations

from pathlib import Path

from scaletrain.checkpoint.hf.core import init_from_problems
from scaletrain.checkpoint.hf.in_training import pipeline_problem
from scaletrain.checkpoint.problems import checkpoint_problems, run_dir_problems, saving_problems
from scaletrain.config import Config, TrainingConfig
from scaletrain.config.io import fields_typed, parse_config, resolve_paths, saved_config, to_dict
from scaletrain.data.loader import data_problems, tokenizer_vocab
from scaletrain.data.ramp import BatchRamp
from scaletrain.data.schedule import schedule_problems
from scaletrain.errors import ConfigError
from scaletrain.hardware import cuda_available, uses_cuda
from scaletrain.metrics.profile import profile_problems
from scaletrain.metrics.writer import metrics_problems
from scaletrain.models.llama import ModelArgs
from scaletrain.models.presets import (
    PRESETS,
    model_problems,
    model_shape_problems,
    moe_problems,
    resolvable,
    resolve_model_args,
)
from scaletrain.optim.optimizers import optimizer_problems
from scaletrain.optim.qk_clip import qk_clip_problems
from scaletrain.parallel.layout import (
    Layout,
    attention_problems,
    batch_problems,
    comm_problems,
    rank_problems,
)
from scaletrain.parallel.offload import memory_problems
from scaletrain.planning.estimators.memory import fits_in_memory_problems
from scaletrain.precision.policy import precision_problems
from scaletrain.precision.qat import qat_problems
from scaletrain.resilience import fault_tolerance
from scaletrain.resilience.guard import resilience_problems
from scaletrain.resilience.membership import restart_count
from scaletrain.resilience.sdc import sdc_layout_problems, sdc_problems
from scaletrain.resilience.timelimit import limit_problems
from scaletrain.run.directory import RunDir
from scaletrain.run.resume import resume_problems


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
        problems += resume_problems(saved_config(run.config), to_dict(cfg), cfg.run.accept_changes)
    if problems:
        raise ConfigError(problems)
    return cfg


def _run_tokens(t: TrainingConfig, layout: Layout, seq_len: int) -> int:
    """Tokens training.steps consume (what data.schedule's shares are of); a bad batch_ramp is reported apart."""
    try:
        return BatchRamp.of(t.batch_ramp, layout.global_batch).consumed(t.steps) * seq_len
    except ValueError:
        return t.steps * layout.global_batch * seq_len


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
    problems = model_problems(cfg.model)
    if cfg.model.preset in PRESETS:  # an unknown preset is model.*'s one problem
        problems += init_from_problems(cfg.model.init_from)
    vocab = tokenizer_vocab(cfg.data.tokenizer)
    # The shape checks need a known preset and sizes >= 1; model_problems reported what is wrong otherwise.
    args = (
        resolve_model_args(cfg.model, vocab, cfg.data.seq_len, moe=cfg.moe) if resolvable(cfg.model) else None
    )
    shapes: list[str] = []  # what the layout checks build on, with the step's batch split (training below)
    if args is not None:
        shapes += model_shape_problems(args, cfg.model, vocab)
        shapes += moe_problems(cfg.moe, args, cfg.model.preset)
        problems += shapes
        problems += _sparse_blocks(cfg, args)
        problems += _deepseek(cfg, args)
        problems += qat_problems(cfg.precision, args, tp=cfg.parallel.tp)
    problems += data_problems(cfg.data)
    problems += schedule_problems(cfg.data, _run_tokens(cfg.training, layout, cfg.data.seq_len))
    training = _training(cfg.training, layout)
    problems += training
    problems += optimizer_problems(cfg.optimizer)
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
    problems += metrics_problems(cfg.metrics)
    if cfg.parallel.ddp_bucket_mb < 1:
        problems.append("parallel.ddp_bucket_mb must be >= 1")
    problems += comm_problems(layout)
    cuda = uses_cuda(cfg.training.device)
    problems += profile_problems(cfg.profile, cfg.training.steps, world_size, cuda)
    problems += checkpoint_problems(cfg.checkpoint)
    problems += [p for p in [pipeline_problem(cfg.checkpoint.last_save_in_hf, cfg.parallel.pp)] if p]
    problems += saving_problems(cfg.checkpoint, check_storage=check_run_dir)
    # fault_tolerance: a replica group g > 0 started again heals from a live peer; it never reads the checkpoints.
    problems += (
        run_dir_problems(cfg.run, cfg.checkpoint, heals=cfg.fault_tolerance.group > 0)
        if check_run_dir
        else []
    )
    problems += limit_problems(cfg.run, cfg.training.steps, cfg.checkpoint.enabled)
    # A job torchrun re-formed may be smaller than the world its faults were written for (a node left, --nnodes
    # 1:2): a fault of a rank it lacks fires if the node comes back, so only a first start refuses one as a typo.
    problems += resilience_problems(cfg.resilience, None if restart_count() else world_size)
    problems += sdc_problems(cfg.resilience, cfg.checkpoint)
    problems += sdc_layout_problems(cfg)
    problems += fault_tolerance.problems(cfg, world_size)
    device = "cuda" if cuda else "cpu"
    problems += memory_problems(cfg.memory, device, cfg.parallel.data_parallel, layout.fsdp)
    # precision.compute against the layout (where the FSDP2 policy can apply) and the device (fp8's hardware)
    problems += precision_problems(cfg.precision, layout.fsdp, device, tp=cfg.parallel.tp)
    problems += _attention(cfg, args)
    if cfg.model.loss == "whole_compiled" and cfg.parallel.tp > 1:
        problems.append(
            "model.loss 'whole_compiled' with parallel.tp > 1 is refused: the vocabulary-parallel loss "
            "(DTensor logits under loss_parallel) is not compiled here, untested; use whole or chunked"
        )
    # The layout checks build on the resolved shapes and the batch split only, so they are reported with every other
    # problem at once; the memory check plans the whole job, so it runs only on a config with nothing else wrong.
    if args is not None and not shapes and not training:
        problems += rank_problems(cfg, layout, args)
    if not problems and args is not None:
        problems += fits_in_memory_problems(cfg, layout, args)
    return problems


def _sparse_blocks(cfg: Config, args: ModelArgs) -> list[str]:
    """MoE and MLA blocks against what was tested only on dense Llama-style blocks (compile, per-op recompute)."""
    problems = []
    if args.n_experts > 0 and cfg.training.compile:
        problems.append(
            "training.compile with MoE blocks is refused: the experts' data-dependent token splits break "
            "each compiled block into pieces, and compiled MoE has not been tested against eager; set "
            "training.compile = false"
        )
    if cfg.memory.recompute == "selective_op" and (args.n_experts > 0 or args.mla):
        problems.append(
            "memory.recompute selective_op is refused with MoE or MLA blocks: it recomputes every second "
            "Linear of a block by position, which the planner models and the tests check for dense "
            "Llama-style blocks only; use selective or full"
        )
    return problems


def _deepseek(cfg: Config, args: ModelArgs) -> list[str]:
    """DeepSeek-V3's switches (MLA, multi-token prediction) against other sections' options."""
    problems = []
    if args.mla and cfg.optimizer.qk_clip > 0:
        problems.append(
            "optimizer.qk_clip with multi-head latent attention (model.kv_lora_rank > 0) is refused: QK-clip "
            "measures and rescales wq and wk per head, and MLA's keys come from a latent shared by every head; "
            "set optimizer.qk_clip = 0"
        )
    if args.mtp_depth and cfg.data.document_mask:
        problems.append(
            "model.mtp_depth with data.document_mask is refused: the MTP block attends causally over the whole "
            "packed sequence; set data.document_mask = false or model.mtp_depth = 0"
        )
    return problems


def _attention(cfg: Config, args: ModelArgs | None) -> list[str]:
    """model.attention, model.window and data.document_mask against the device (and, in attention_problems, the
    parallel layout)."""
    m, problems = cfg.model, []
    if (m.window or 0) < 0 or (m.window_every is not None and m.window_every < 1):
        problems.append(
            f"model.window must be >= 0 (0: off) and model.window_every >= 1, got {m.window} and {m.window_every}"
        )
    window = args.window if args is not None else m.window or 0  # the preset's when unset
    masked = cfg.data.document_mask or window > 0
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
    return problems + (attention_problems(cfg, args) if args is not None else [])


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
