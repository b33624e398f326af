"""The training loop, top to bottom: set up, resume, then forward/backward, clip, step, log, evaluate, checkpoint.
It owns no mechanism; each piece lives in its own package and is tested there."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
import uuid
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from scaletrain.checkpoint import (
    CheckpointManager,
    LoaderState,
    ModelState,
    OptimizerState,
    SchedulerState,
    TrainState,
)
from scaletrain.checkpoint.interval import interval_steps
from scaletrain.config import Config, TrainingConfig, to_dict
from scaletrain.config_io import write_toml
from scaletrain.data import build_loader, load_tokenizer, resolve_cache_dir
from scaletrain.errors import UserError
from scaletrain.metrics import (
    MetricsWriter,
    Progress,
    device_peak_flops,
    flops_per_token,
    mfu,
    peak_memory_mib,
    print_summary,
)
from scaletrain.models import build_meta_model, count_parameters, resolve_model_args
from scaletrain.optim import build_lr_scheduler, build_optimizer
from scaletrain.parallel import DistEnv, ParallelDims, init_distributed
from scaletrain.parallel.mesh import all_reduce_mean, broadcast_object
from scaletrain.parallel.parallelize import parallelize
from scaletrain.resilience.guard import Guard
from scaletrain.step import StepRunner
from scaletrain.validate import global_batch_sequences

log = logging.getLogger("scaletrain")


def train(cfg: Config) -> dict:
    """Run the configured job; return the final summary (also printed and written to events.jsonl)."""
    t_start = time.perf_counter()
    env = init_distributed(cfg.training.device)
    _setup_process(cfg.training, env)
    dims = ParallelDims.from_config(cfg.parallel, env.world_size)
    world = dims.build_mesh(env.device.type)
    run_dir, run_id = _open_run_dir(cfg, env, world)
    writer = MetricsWriter(run_dir, enabled=env.is_main, tensorboard=cfg.metrics.tensorboard)
    preempted = _PreemptionFlag()

    # Data: rank 0 tokenises (or finds the cache) first, the other ranks then read the same shards. Every rank of
    # one data-parallel group (its tp, cp and pp peers) reads the same slice of the global batch.
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    global_batch = global_batch_sequences(cfg.training, cfg.data.seq_len)
    loader = _main_first(
        env,
        world,
        lambda: build_loader(
            cfg.data, tokenizer, global_batch, dims.dp_rank, dims.dp_size, cfg.training.seed, log.info
        ),
    )

    # Model: built on meta, materialised with a fixed seed, then parallelised (and wrapped) from outside.
    args = resolve_model_args(cfg.model, tokenizer.vocab_size, cfg.data.seq_len)
    model = _build_model(args, cfg, env.device)
    n_params = count_parameters(model)
    local_batch = global_batch // dims.dp_size
    pm = parallelize(
        model,
        dims,
        cfg.parallel,
        device=env.device,
        n_microbatches=cfg.parallel.pp_microbatches or max(1, local_batch // cfg.training.micro_batch),
    )
    del model
    optimizers = [_build_optimizer(part, cfg, env.device, dims) for part in pm.parts]
    schedulers = [build_lr_scheduler(o, cfg.optimizer, cfg.training.steps) for o in optimizers]
    runner = _step_runner(pm, dims, cfg, env.device)

    # Everything that resumes, in one dict of Stateful objects: storage checkpoints (DCP), the in-memory tier and
    # rollbacks all save and restore this. On start the newest complete copy across tiers is loaded.
    train_state = TrainState(dist.group.WORLD if world is not None else None)
    state = {
        "model": ModelState(pm.parts),
        "optimizer": OptimizerState(pm.parts, _inner(optimizers)),
        "lr_scheduler": SchedulerState(schedulers),
        "data": LoaderState(loader),
        "train": train_state,
    }
    guard = Guard(
        cfg.resilience,
        run_dir,
        rank=env.rank,
        world_size=env.world_size,
        layout=_layout(dims, cfg),
        vocab_size=args.vocab_size,
        event=writer.event,
        device_type=env.device.type,
        run_id=run_id,
    )
    ckpt = (
        CheckpointManager(
            cfg.checkpoint,
            cfg.checkpoint.storage or str(run_dir / "checkpoints"),
            state,
            rank=env.rank,
            world_size=env.world_size,
            event=writer.event,
            on_commit=guard.after_commit,
        )
        if cfg.checkpoint.enabled
        else None
    )
    guard.resume(state, ckpt)
    start = train_state.step

    peak, peak_source = _main_first(
        env,
        world,
        lambda: device_peak_flops(
            env.device, cfg.training.precision, cfg.metrics.peak_tflops, resolve_cache_dir(cfg.data)
        ),
    )
    flops_tok = flops_per_token(n_params["non_embedding"], args.n_layers, args.dim, cfg.data.seq_len)
    tokens_per_step = global_batch * cfg.data.seq_len
    log.info(
        "model %s: %s parameters (%s without the embedding); layout %s",
        cfg.model.preset,
        f"{n_params['total']:,}",
        f"{n_params['non_embedding']:,}",
        _layout(dims, cfg),
    )
    log.info(
        "precision %s on %s x%d (%s); global batch %d sequences = %d tokens, micro-batch %d; MFU peak: %s",
        cfg.training.precision,
        env.device.type,
        env.world_size,
        "deterministic" if cfg.training.deterministic else "non-deterministic",
        global_batch,
        tokens_per_step,
        cfg.training.micro_batch,
        peak_source,
    )
    writer.event(
        "start",
        step=start,
        world_size=env.world_size,
        precision=cfg.training.precision,
        device=env.device.type,
        parameters=n_params["total"],
        layout=_layout(dims, cfg),
        peak_flops_source=peak_source,
        resumed=start > 0,
        restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    )

    evals = {}
    if cfg.training.eval_interval and start == 0:
        evals[0] = _evaluate(runner, loader, cfg.training, dims, env.device)
        writer.event("eval", step=0, val_loss=evals[0], val_ppl=math.exp(min(evals[0], 50)))
    interval = cfg.checkpoint.interval if isinstance(cfg.checkpoint.interval, int) else 0
    # Probed in every run segment, so a restarted worker measures again rather than never saving.
    probe_at = start + _AUTO_PROBE_STEP if cfg.checkpoint.interval == "auto" else None
    last: dict = {}
    step = start
    window_t0, window_steps, excluded = time.perf_counter(), 0, 0.0
    segment_t0 = window_t0
    success = False
    try:
        with Progress(cfg.training.steps, start, enabled=env.is_main and cfg.metrics.progress) as progress:
            while step < cfg.training.steps:
                step += 1
                guard.step_start(step)
                inputs, targets = guard.batch(step, *loader.next_batch())
                lr = schedulers[0].get_last_lr()[0]
                loss = runner.forward_backward(
                    inputs.to(env.device), targets.to(env.device), loss_factor=guard.loss_factor(step)
                )
                grad_norm = runner.clip()
                if ckpt is not None:  # a save in flight must have copied the weights before they change
                    excluded += ckpt.before_update()  # a checkpoint stall, not step time
                decision = guard.check(
                    step, loss, grad_norm, lambda x=loss: all_reduce_mean(x, dims.submesh("dp_cp"))
                )
                if decision == "ok":
                    for opt, sched in zip(optimizers, schedulers, strict=True):
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                        sched.step()
                    train_state.step, train_state.tokens = step, step * tokens_per_step
                else:
                    guard.skip(optimizers)
                    if decision == "rollback":
                        restored = guard.rollback(step, state, ckpt, loader)
                        step = restored if restored is not None else step
                        window_t0, window_steps, excluded = time.perf_counter(), 0, 0.0
                        continue
                window_steps += 1

                is_eval = cfg.training.eval_interval and (
                    step % cfg.training.eval_interval == 0 or step == cfg.training.steps
                )
                if step % cfg.metrics.log_interval == 0 or step == cfg.training.steps or is_eval:
                    now = time.perf_counter()
                    elapsed = now - window_t0 - excluded
                    tps = window_steps * tokens_per_step / elapsed
                    last = {
                        "loss": all_reduce_mean(loss, dims.submesh("dp_cp")).item(),
                        "lr": lr,
                        "grad_norm": grad_norm.item(),
                        "tokens": step * tokens_per_step,
                        "tokens_per_s": tps,
                        "mfu": mfu(tps, flops_tok, peak * env.world_size),
                        "mem_peak_mib": peak_memory_mib(env.device),
                        "step_time_s": elapsed / window_steps,
                    }
                    if is_eval:
                        t_eval = time.perf_counter()
                        evals[step] = _evaluate(runner, loader, cfg.training, dims, env.device)
                        now += time.perf_counter() - t_eval  # evaluation is not training time
                        last.update(val_loss=evals[step], val_ppl=math.exp(min(evals[step], 50)))
                        writer.event(
                            "eval",
                            step=step,
                            val_loss=evals[step],
                            val_ppl=last["val_ppl"],
                            duration_s=time.perf_counter() - t_eval,
                        )
                    if step == cfg.training.steps and env.is_main:
                        last["goodput"] = _goodput(run_dir, dict(last, step=step))
                    writer.log(step, last)
                    _log_line(step, cfg.training.steps, last)
                    # Logging costs count in the next window: tokens/s is wall-clock honest.
                    window_t0, window_steps, excluded = now, 0, 0.0
                progress.update(step, last.get("loss", float("nan")), last.get("tokens_per_s", 0.0), lr)

                if ckpt is not None and preempted.agreed(world):
                    ckpt.save(step, blocking=True)
                    writer.event("preempted", step=step, signal="SIGTERM")
                    log.warning("SIGTERM: saved a checkpoint at step %d and stopping", step)
                    break
                if ckpt is not None and step < cfg.training.steps:
                    if step == probe_at:  # checkpoint.interval = "auto": measure a save, then choose
                        interval, blocked = _auto_interval(
                            ckpt,
                            guard,
                            step,
                            (time.perf_counter() - segment_t0) / (step - start),
                            cfg,
                            writer,
                            env.device.type,
                        )
                        excluded += blocked
                        probe_at = (
                            None if interval else step + _AUTO_PROBE_STEP
                        )  # the probe failed: again later
                    elif interval and step % interval == 0:
                        excluded += _save(ckpt, guard, step, writer) or 0.0
                    ckpt.poll()
                guard.step_end(step, state)
        success = step == cfg.training.steps
    except KeyboardInterrupt:
        writer.event("interrupted", step=step)
        writer.close()
        raise
    finally:
        guard.close(success)
    if ckpt is not None:
        if step == cfg.training.steps and step not in ckpt.committed_steps():
            ckpt.save(step, blocking=True)
        ckpt.close()
    summary = _summary(cfg, run_dir, last, evals, time.perf_counter() - t_start, env, step)
    writer.event("end", step=step, **{k: v for k, v in summary.items() if k != "run_dir"})
    writer.close()
    if env.is_main:
        print_summary({k: _fmt(v) for k, v in summary.items() if k != "run_dir"})
        print(f"run directory: {run_dir}")
    return summary


def _build_model(args, cfg: Config, device: torch.device) -> nn.Module:
    """Materialise the whole model with the seed before sharding, so that every parallel layout starts from the
    same weights as the single-process run (what makes layouts comparable step by step)."""
    model = build_meta_model(args)
    model.to_empty(device=device)
    torch.manual_seed(cfg.training.seed)
    model.init_weights(device)
    if cfg.model.init_from.startswith("hf:"):
        from scaletrain.checkpoint.hf import load_hf_weights

        load_hf_weights(model, Path(cfg.model.init_from[3:]))
        log.info("initialised from Hugging Face weights in %s", cfg.model.init_from[3:])
    return model


def _build_optimizer(part: nn.Module, cfg: Config, device: torch.device, dims: ParallelDims):
    if cfg.parallel.data_parallel == "zero1" and dims.size("dp_cp") > 1:
        from scaletrain.parallel.data_parallel import build_zero1_optimizer

        return build_zero1_optimizer(part, cfg.optimizer, device, dims.submesh("dp_cp"))
    return build_optimizer(part, cfg.optimizer, device)


def _inner(optimizers: list) -> list:
    """ZeRO-1 keeps its rank's AdamW over its share of parameters; checkpoints save that share by parameter name."""
    return [getattr(o, "optim", o) for o in optimizers]


def _step_runner(pm, dims: ParallelDims, cfg: Config, device: torch.device) -> StepRunner:
    from scaletrain.parallel.tensor_parallel import loss_context

    cp_shard = None
    if dims.cp_enabled:
        from scaletrain.parallel.context_parallel import cp_shard_batch

        def cp_shard(x, y):
            return cp_shard_batch(x, y, dims.submesh("cp"), cfg.parallel.cp_load_balance)

    return StepRunner(
        pm.parts,
        cfg.training.micro_batch,
        _autocast(cfg.training.precision, device),
        cfg.training.grad_clip,
        loss_context=lambda: loss_context(pm.loss_parallel),
        cp_shard=cp_shard,
        pipeline=pm.pipeline,
        pp_mesh=dims.submesh("pp") if dims.pp_enabled else None,
    )


@torch.no_grad()
def _evaluate(
    runner: StepRunner, loader, t: TrainingConfig, dims: ParallelDims, device: torch.device
) -> float:
    """Mean validation loss per token over the held-out sequences (sharded over data-parallel ranks)."""
    for part in runner.parts:
        part.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in loader.val_batches(t.eval_sequences, t.micro_batch):
        loss_sum, n = runner.eval_loss_sum(x.to(device), y.to(device))
        total[0] += loss_sum
        total[1] += n
    for part in runner.parts:
        part.train()
    mesh = dims.submesh("dp_cp")
    if mesh is not None:
        dist.all_reduce(total, group=mesh.get_group())
    return (total[0] / total[1]).item()


_AUTO_PROBE_STEP = 5


def _save(
    ckpt: CheckpointManager, guard: Guard, step: int, writer: MetricsWriter, blocking: bool = False
) -> float | None:
    """Start a save; a failing one (e.g. a full disk) is reported and training goes on: the previous checkpoint
    is untouched. Returns the seconds training was blocked, None when the save failed."""
    try:
        guard.before_save(step)
        return ckpt.save(step, blocking=blocking)
    except OSError as e:
        writer.event("checkpoint_failed", step=step, error=str(e))
        log.error(
            "step %d: checkpoint save failed (%s); training continues, the previous checkpoint stays", step, e
        )
        return None


def _goodput(run_dir: Path, last_record: dict) -> float | None:
    from scaletrain.resilience.goodput import compute_goodput

    try:
        return compute_goodput(run_dir, pending=last_record, now=time.time())["goodput"]
    except (ValueError, OSError):
        return None


def _auto_interval(
    ckpt: CheckpointManager,
    guard: Guard,
    step: int,
    step_time: float,
    cfg: Config,
    writer: MetricsWriter,
    device_type: str,
) -> tuple[int, float]:
    """Save once to measure what a save costs (delta), then pick the Young/Daly interval from it; returns the
    interval in steps (0 when the probe save failed) and the seconds it blocked. On CPU the background write competes with training for
    the same cores, so delta is the whole save (written synchronously); on a GPU it is what the save blocks."""
    cpu = device_type == "cpu"
    delta = _save(ckpt, guard, step, writer, blocking=cpu)
    if delta is None:
        return 0, 0.0
    interval = interval_steps(delta, cfg.checkpoint.mtbf_hours * 3600, step_time)
    log.info(
        "checkpoint.interval = auto: a save costs %.3fs (%s), MTBF %.2fh, step %.3fs -> every %d steps",
        delta,
        "whole save, CPU" if cpu else "blocking part",
        cfg.checkpoint.mtbf_hours,
        step_time,
        interval,
    )
    writer.event(
        "checkpoint_interval",
        step=step,
        cost_s=delta,
        cost="whole save" if cpu else "blocking",
        mtbf_hours=cfg.checkpoint.mtbf_hours,
        step_time_s=step_time,
        interval_steps=interval,
    )
    return interval, delta


class _PreemptionFlag:
    """SIGTERM (preemption) sets a flag; ranks agree on it at a step boundary, so they all save the same step."""

    def __init__(self):
        self.flag = False
        with contextlib.suppress(ValueError):  # not the main thread (e.g. inside a test harness)
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.flag = True

    def agreed(self, world: DeviceMesh | None) -> bool:
        if world is None:
            return self.flag
        t = torch.tensor([float(self.flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


def _setup_process(t: TrainingConfig, env: DistEnv) -> None:
    logging.basicConfig(
        level=logging.INFO if env.is_main else logging.WARNING,
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    threads = t.threads or max(1, (os.cpu_count() or 1) // env.local_world_size)
    torch.set_num_threads(threads)
    if t.deterministic:
        # Same kernels, same reduction order, same thread count: bit-identical CPU runs.
        torch.use_deterministic_algorithms(True)
    if env.device.type == "cuda":
        # "fp32" means fp32: TF32 matmuls would silently compute with a 10-bit mantissa.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def _autocast(precision: str, device: torch.device):
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _open_run_dir(cfg: Config, env: DistEnv, world: DeviceMesh | None) -> tuple[Path, str]:
    """Resolve the run directory on rank 0 (a default one carries a timestamp), create it, write config.toml;
    return it and the run's id (made when the directory is first used, the same for every restart)."""
    if not cfg.run.name:
        cfg.run.name = "run"
    if not cfg.run.dir:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        cfg.run.dir = str(broadcast_object(f"runs/{cfg.run.name}-{stamp}", world))
    run_dir = Path(cfg.run.dir)
    run_id = None
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_toml(to_dict(cfg), run_dir / "config.toml")
        id_file = run_dir / "run_id"
        if not id_file.exists():
            id_file.write_text(uuid.uuid4().hex + "\n")
        run_id = id_file.read_text().strip()
    return run_dir, broadcast_object(run_id, world)


def _main_first(env: DistEnv, world: DeviceMesh | None, fn):
    """Run fn on rank 0, then on the others; a UserError on rank 0 is raised on every rank instead of leaving
    them waiting at a barrier until the timeout."""
    result, error = None, None
    if env.is_main:
        try:
            result = fn()
        except UserError as e:
            error = str(e)
    error = broadcast_object(error, world)
    if error is not None:
        raise UserError(error)
    return result if env.is_main else fn()


def _layout(dims: ParallelDims, cfg: Config) -> str:
    sizes = [
        f"{n}{getattr(dims, n)}"
        for n in ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        if getattr(dims, n) > 1
    ]
    extra = [cfg.parallel.data_parallel] if dims.dp_size * dims.cp > 1 else []
    extra += [cfg.parallel.pp_schedule] if dims.pp > 1 else []
    extra += ["sequence-parallel"] if cfg.parallel.sequence_parallel else []
    return " x ".join(sizes) + (f" ({', '.join(extra)})" if extra else "") if sizes else "single process"


def _log_line(step: int, total: int, m: dict) -> None:
    val = f" | val {m['val_loss']:.4f}" if "val_loss" in m else ""
    log.info(
        "step %d/%d | loss %.4f%s | lr %.2e | gnorm %.3f | %.0f tok/s | mfu %.2f%% | mem %.0f MiB",
        step,
        total,
        m["loss"],
        val,
        m["lr"],
        m["grad_norm"],
        m["tokens_per_s"],
        100 * m["mfu"],
        m["mem_peak_mib"],
    )


def _summary(
    cfg: Config, run_dir: Path, last: dict, evals: dict, wall: float, env: DistEnv, step: int
) -> dict:
    steps = sorted(evals)
    return {
        "steps": step,
        "tokens": last.get("tokens", 0),
        "final_loss": last.get("loss"),
        "first_val_loss": evals[steps[0]] if steps else None,
        "final_val_loss": evals[steps[-1]] if steps else None,
        "tokens_per_s": last.get("tokens_per_s"),
        "mfu": last.get("mfu"),
        "goodput": last.get("goodput"),
        "wall_s": wall,
        "world_size": env.world_size,
        "run_dir": str(run_dir),
    }


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
