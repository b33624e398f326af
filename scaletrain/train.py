"""The training loop, top to bottom: set up, then accumulate, clip, step, log, evaluate. It owns no mechanism;
each piece lives in its own package and is tested there."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

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
from scaletrain.parallel import DistEnv, ParallelDims, apply_ddp, init_distributed
from scaletrain.parallel.mesh import all_reduce_mean, broadcast_object
from scaletrain.validate import global_batch_sequences

log = logging.getLogger("scaletrain")


def train(cfg: Config) -> dict:
    """Run the configured job; return the final summary (also printed and written to events.jsonl)."""
    t_start = time.perf_counter()
    env = init_distributed(cfg.training.device)
    _setup_process(cfg.training, env)
    mesh = ParallelDims(dp=env.world_size).build_mesh(env.device)
    run_dir = _open_run_dir(cfg, env, mesh)
    writer = MetricsWriter(run_dir, enabled=env.is_main, tensorboard=cfg.metrics.tensorboard)

    # Data: rank 0 tokenises (or finds the cache) first, the other ranks then read the same shards.
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    global_batch = global_batch_sequences(cfg.training, cfg.data.seq_len)
    loader = _main_first(env, mesh, lambda: build_loader(
        cfg.data, tokenizer, global_batch, env.rank, env.world_size, cfg.training.seed, log.info))

    # Model: built on meta, materialised on the device, then wrapped for data parallelism.
    args = resolve_model_args(cfg.model, tokenizer.vocab_size, cfg.data.seq_len)
    model = build_meta_model(args)
    model.to_empty(device=env.device)
    torch.manual_seed(cfg.training.seed)
    model.init_weights(env.device)
    n_params = count_parameters(model)
    if mesh is not None:
        model = apply_ddp(model, mesh, bucket_mb=cfg.parallel.ddp_bucket_mb)
    optimizer = build_optimizer(model, cfg.optimizer, env.device)
    scheduler = build_lr_scheduler(optimizer, cfg.optimizer, cfg.training.steps)
    autocast = _autocast(cfg.training.precision, env.device)

    # Rank 0 measures a CPU's peak (and caches it) alone, so that ranks sharing the cores do not skew it.
    peak, peak_source = _main_first(env, mesh, lambda: device_peak_flops(
        env.device, cfg.training.precision, cfg.metrics.peak_tflops, resolve_cache_dir(cfg.data)))
    flops_tok = flops_per_token(n_params["non_embedding"], args.n_layers, args.dim, cfg.data.seq_len)
    tokens_per_step = global_batch * cfg.data.seq_len
    accum = global_batch // (cfg.training.micro_batch * env.world_size)
    log.info("model %s: %s parameters (%s without the embedding)", cfg.model.preset, f"{n_params['total']:,}",
             f"{n_params['non_embedding']:,}")
    log.info("precision %s on %s x%d (%s); global batch %d sequences = %d tokens; micro-batch %d, %d accumulation "
             "step(s); MFU peak: %s", cfg.training.precision, env.device.type, env.world_size,
             "deterministic" if cfg.training.deterministic else "non-deterministic", global_batch, tokens_per_step,
             cfg.training.micro_batch, accum, peak_source)
    writer.event("start", step=0, world_size=env.world_size, precision=cfg.training.precision,
                 device=env.device.type, parameters=n_params["total"], peak_flops_source=peak_source)

    evals = {0: _evaluate(model, loader, cfg.training, autocast, mesh, env.device)} if cfg.training.eval_interval else {}
    for s, v in evals.items():
        writer.event("eval", step=s, val_loss=v, val_ppl=math.exp(min(v, 50)))
    last: dict = {}
    step = 0
    window_t0, window_steps = time.perf_counter(), 0
    try:
        with Progress(cfg.training.steps, 0, enabled=env.is_main and cfg.metrics.progress) as progress:
            for step in range(1, cfg.training.steps + 1):
                inputs, targets = loader.next_batch()
                lr = scheduler.get_last_lr()[0]
                loss, grad_norm = train_step(model, optimizer, scheduler, inputs.to(env.device),
                                             targets.to(env.device), micro_batch=cfg.training.micro_batch,
                                             autocast=autocast, grad_clip=cfg.training.grad_clip)
                window_steps += 1
                is_eval = cfg.training.eval_interval and (step % cfg.training.eval_interval == 0
                                                          or step == cfg.training.steps)
                if step % cfg.metrics.log_interval and step != cfg.training.steps and not is_eval:
                    progress.update(step, last.get("loss", float("nan")), last.get("tokens_per_s", 0.0), lr)
                    continue
                now = time.perf_counter()
                elapsed = now - window_t0
                tps = window_steps * tokens_per_step / elapsed
                last = {
                    "loss": all_reduce_mean(loss, mesh).item(), "lr": lr, "grad_norm": grad_norm.item(),
                    "tokens": step * tokens_per_step, "tokens_per_s": tps,
                    "mfu": mfu(tps, flops_tok, peak * env.world_size), "mem_peak_mib": peak_memory_mib(env.device),
                    "step_time_s": elapsed / window_steps,
                }
                if is_eval:
                    t_eval = time.perf_counter()
                    evals[step] = _evaluate(model, loader, cfg.training, autocast, mesh, env.device)
                    now += time.perf_counter() - t_eval  # evaluation is not training time
                    last.update(val_loss=evals[step], val_ppl=math.exp(min(evals[step], 50)))
                    writer.event("eval", step=step, val_loss=evals[step], val_ppl=last["val_ppl"])
                writer.log(step, last)
                _log_line(step, cfg.training.steps, last)
                progress.update(step, last["loss"], tps, lr)
                # Logging costs count in the next window: tokens/s is wall-clock honest.
                window_t0, window_steps = now, 0
    except KeyboardInterrupt:
        writer.event("interrupted", step=step)
        writer.close()
        raise
    summary = _summary(cfg, run_dir, last, evals, time.perf_counter() - t_start, env)
    writer.event("end", step=cfg.training.steps, **{k: v for k, v in summary.items() if k != "run_dir"})
    writer.close()
    if env.is_main:
        print_summary({k: _fmt(v) for k, v in summary.items() if k != "run_dir"})
        print(f"run directory: {run_dir}")
    return summary


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, inputs: torch.Tensor,
               targets: torch.Tensor, *, micro_batch: int, autocast, grad_clip: float):
    """One optimizer step over this rank's share of the global batch, split into micro-batches.

    Each micro-batch loss is divided by the number of micro-batches, so the summed gradient is the mean over the
    rank's sequences; DDP then averages over ranks, giving the mean over the global batch. DDP's all-reduce runs
    only on the last micro-batch (no_sync before it)."""
    xs, ys = inputs.split(micro_batch), targets.split(micro_batch)
    n = len(xs)
    loss_sum = torch.zeros((), device=inputs.device)
    for i, (x, y) in enumerate(zip(xs, ys)):
        sync = contextlib.nullcontext() if i == n - 1 or not isinstance(model, DDP) else model.no_sync()
        with sync:
            with autocast:
                logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            (loss / n).backward()
        loss_sum += loss.detach()
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else math.inf, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return loss_sum / n, grad_norm


@torch.no_grad()
def _evaluate(model: nn.Module, loader, t: TrainingConfig, autocast, mesh: DeviceMesh | None,
              device: torch.device) -> float:
    """Mean validation loss per token over the held-out sequences (sharded over ranks)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in loader.val_batches(t.eval_sequences, t.micro_batch):
        with autocast:
            logits = model(x.to(device))
        total[0] += F.cross_entropy(logits.flatten(0, 1).float(), y.to(device).flatten(), reduction="sum")
        total[1] += y.numel()
    model.train()
    if mesh is not None:
        dist.all_reduce(total, group=mesh.get_group())
    return (total[0] / total[1]).item()


def _setup_process(t: TrainingConfig, env: DistEnv) -> None:
    logging.basicConfig(level=logging.INFO if env.is_main else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", force=True)
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


def _open_run_dir(cfg: Config, env: DistEnv, mesh: DeviceMesh | None) -> Path:
    """Resolve the run directory on rank 0 (a default one carries a timestamp), create it, write config.toml."""
    if not cfg.run.name:
        cfg.run.name = "run"
    if not cfg.run.dir:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        cfg.run.dir = str(broadcast_object(f"runs/{cfg.run.name}-{stamp}", mesh))
    run_dir = Path(cfg.run.dir)
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_toml(to_dict(cfg), run_dir / "config.toml")
    return run_dir


def _main_first(env: DistEnv, mesh: DeviceMesh | None, fn):
    """Run fn on rank 0, then on the others; a UserError on rank 0 is raised on every rank instead of leaving
    them waiting at a barrier until the timeout."""
    result, error = None, None
    if env.is_main:
        try:
            result = fn()
        except UserError as e:
            error = str(e)
    error = broadcast_object(error, mesh)
    if error is not None:
        raise UserError(error)
    return result if env.is_main else fn()


def _log_line(step: int, total: int, m: dict) -> None:
    val = f" | val {m['val_loss']:.4f}" if "val_loss" in m else ""
    log.info("step %d/%d | loss %.4f%s | lr %.2e | gnorm %.3f | %.0f tok/s | mfu %.2f%% | mem %.0f MiB", step,
             total, m["loss"], val, m["lr"], m["grad_norm"], m["tokens_per_s"], 100 * m["mfu"], m["mem_peak_mib"])


def _summary(cfg: Config, run_dir: Path, last: dict, evals: dict, wall: float, env: DistEnv) -> dict:
    steps = sorted(evals)
    return {
        "steps": cfg.training.steps,
        "tokens": last.get("tokens", 0),
        "final_loss": last.get("loss"),
        "first_val_loss": evals[steps[0]] if steps else None,
        "final_val_loss": evals[steps[-1]] if steps else None,
        "tokens_per_s": last.get("tokens_per_s"),
        "mfu": last.get("mfu"),
        "wall_s": wall,
        "world_size": env.world_size,
        "run_dir": str(run_dir),
    }


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
