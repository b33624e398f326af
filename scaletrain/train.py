"""The training loop, top to bottom: `build` (job.py) sets everything up, then each step runs batch -> forward/backward ->
clip -> health check -> optimizer step -> log/eval -> preemption -> checkpoint. It owns no mechanism: each one lives
with the object that owns its data (the checkpoint policy in CheckpointManager, preemption in Preemption, the
throughput window in StepMeter, what a skipped step advances in Optimizers) and is tested there."""

from __future__ import annotations

import logging
import math
import time

import torch

from scaletrain import metrics
from scaletrain.config import Config
from scaletrain.job import Job, build
from scaletrain.parallel.mesh import all_reduce_mean
from scaletrain.resilience.goodput import final_goodput

log = logging.getLogger("scaletrain")


def train(cfg: Config) -> dict:
    """Run the configured job; return the final summary (also printed and written to events.jsonl)."""
    t_start = time.perf_counter()
    job = build(cfg)
    t, device = cfg.training, job.env.device
    step = start = job.resume()
    last: dict = {}
    end = job.limits.begin(start)  # run.stop_at_step, else training.steps
    profiler = metrics.Profiler(cfg.profile, job.run.path, job.env.rank, device)  # profile.steps, if any
    try:
        with metrics.Progress(t.steps, start, enabled=job.env.is_main and cfg.metrics.progress) as progress:
            while step < end:
                # fault_tolerance: the quorum; a healed group goes on at its peers' step
                step = job.ft.step_start(step + 1)
                job.guard.step_start(step)
                profiler.step_start(step)
                sequences = job.batches.sequences(step)  # the global batch; smaller early under a batch ramp
                batch = job.next_batch(step, sequences)  # None: data.when_dry = "stop" and a source ran dry
                if batch is None:
                    step -= 1  # the job ends at the last whole step
                    break
                inputs, targets = batch
                lr = job.optimizers.lr
                loss = job.runner.forward_backward(inputs.to(device), targets.to(device))
                # fault_tolerance: averaged over the replica groups present; a group lost: run the step again
                loss, committed = job.ft.sync(loss)
                if not committed:
                    step -= 1
                    continue
                grad_norm, decision = _update(job, step, loss)
                back = job.guard.rollback(step, job.ckpt, job.loader) if decision == "rollback" else None
                if back is not None:
                    step = back
                    job.meter.reset()
                    continue
                job.step_done(step, sequences)
                if step % cfg.metrics.log_interval == 0 or step == end or job.eval.due(step):
                    last = _log(job, step, loss, grad_norm, lr)
                progress.update(step, last.get("loss", math.nan), last.get("tokens_per_s", 0.0), lr,
                                last.get("mfu"), job.writer.last_event)  # fmt: skip
                if job.stopping(step):
                    if last.get("step") != step:  # stopped between logged steps: the summary shows this one
                        last = _log(job, step, loss, grad_norm, lr)
                    break
                job.meter.exclude(job.ckpt.maybe_save(step))
                job.guard.step_end(step)
                job.meter.exclude(profiler.step_end(step))  # writing the trace is not training time
        stopped = job.close(step)
    except KeyboardInterrupt:
        job.interrupted(step)
        raise
    finally:
        job.release()
    return _finish(job, step, last, time.perf_counter() - t_start, stopped)


def _update(job: Job, step: int, loss: torch.Tensor) -> tuple[torch.Tensor, str]:
    """Clip -> health check -> optimizer step: (grad norm, the guard's decision: "ok", "skip" or "rollback")."""
    grad_norm = job.runner.clip()
    # A save in flight must have copied the weights before the optimizer changes them.
    job.meter.exclude(job.ckpt.before_update())
    # fp16: a step whose scaled gradients overflowed is the loss scaler's to skip, not an anomaly.
    overflow = job.runner.loss_scale_overflow(loss, grad_norm)
    decision = "skip" if overflow else job.guard.check(step, loss, grad_norm)
    job.optimizers.step(skip=decision != "ok")
    job.moe.step_done(step, applied=decision == "ok")  # MoE: load metrics, imbalance watch
    # resilience.sdc_interval: the replicas' fingerprints compared after the update
    return grad_norm, job.guard.after_update(step, decision)


def _log(job: Job, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> dict:
    """One metrics record (the loss averaged over data-parallel ranks; validation on evaluation steps), with its step."""
    record = {
        "loss": all_reduce_mean(loss, job.dims.submesh("dp_cp")).item(),
        "lr": lr,
        "grad_norm": grad_norm.item(),
        "tokens": job.tokens(step),
        **job.meter.read(),
        **job.runner.comm.read(),  # comm_bytes: what this rank's data-parallel collectives sent per step
        **job.runner.scale_metrics(),  # fp16: loss_scale, overflow_skipped
        **job.ft.metrics(),  # fault_tolerance: replicas in this step's quorum
        **job.moe.metrics(),  # MoE: max/mean expert load per layer, dropped fraction, aux and z losses
        # data.streaming: each source's realised share of the samples since the last record (data_share/NAME)
        **job.loader.shares(),
        # QK-clip (optimizer.qk_clip): the step's max_attn_logit and qk_clipped_heads
        **(job.optimizers.qk_clip.metrics() if job.optimizers.qk_clip else {}),
    }
    if job.eval.due(step):
        val = job.eval(step)
        record.update(val_loss=val, val_ppl=math.exp(min(val, 50)))
    job.writer.log(step, record)
    log.info(metrics.log_line(step, job.cfg.training.steps, record))
    return {"step": step, **record}


def _finish(job: Job, step: int, last: dict, wall: float, stopped: str | None) -> dict:
    """The summary at the stop step, the end event, the printed table; rank 0 reads the run's records back for what
    this start lacks (every start's validation losses, the stop step's record, goodput over the whole job)."""
    evals, goodput = job.eval.results, None
    if job.env.is_main:
        evals = {**metrics.recorded_evals(job.run.read_events()), **job.eval.results}
        last = last or metrics.record_at(job.run.read_metrics(), step)
        goodput = final_goodput(job.run.path)
    summary = metrics.run_summary(step, job.tokens(step), last, evals, goodput=goodput, wall_s=wall,
                                  world_size=job.env.world_size)  # fmt: skip
    job.writer.event("end", step=step, stopped=stopped, source_dry=job.limits.dry, **summary)
    job.writer.close()
    if job.env.is_main:
        metrics.print_summary(summary)
        print(f"run directory: {job.run.path}")
    return {**summary, "run_dir": str(job.run.path), "stopped": stopped}
