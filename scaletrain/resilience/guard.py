"""What the train loop calls to stay healthy: fault injection, the hang watchdog, NaN and loss-spike checks with
rollback, straggler detection and the in-memory snapshot tier, behind a few hooks so the loop stays linear."""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from scaletrain.checkpoint.memory_tier import MemoryTier, job_key, make_layout_key
from scaletrain.config import ResilienceConfig
from scaletrain.resilience.faults import FaultInjector
from scaletrain.resilience.health import NanGuard, SpikeDetector, skip_update
from scaletrain.resilience.straggler import StragglerMonitor
from scaletrain.resilience.watchdog import CollectiveTracker, Watchdog, append_event

log = logging.getLogger("scaletrain")


class Guard:
    def __init__(
        self,
        cfg: ResilienceConfig,
        run_dir: Path,
        *,
        rank: int,
        world_size: int,
        layout: str,
        vocab_size: int,
        event,
        device_type: str = "cpu",
        run_id: str = "",
    ):
        self.cfg = cfg
        self.rank = rank
        self.vocab_size = vocab_size
        self.event = event  # rank 0's writer; faults on other ranks append directly
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None
        self.injector = (
            FaultInjector(
                cfg.inject, rank, run_dir, event if rank == 0 else functools.partial(append_event, run_dir)
            )
            if cfg.inject
            else None
        )
        self.tracker = self.watchdog = None
        if cfg.hang_timeout_s > 0:
            self.tracker = CollectiveTracker()
            self.tracker.install()
            self.watchdog = Watchdog(cfg.hang_timeout_s, run_dir, rank, self.tracker)
        self.nan = NanGuard(cfg.nan_rollback_after) if cfg.nan_check else None
        self.spike = SpikeDetector(cfg.spike_window, cfg.spike_zscore) if cfg.spike_zscore > 0 else None
        self.straggler = (
            StragglerMonitor(cfg.straggler_factor, cfg.straggler_interval)
            if cfg.straggler_factor > 0
            else None
        )
        self.memory = (
            MemoryTier(
                job_key(run_dir, run_id),
                make_layout_key(world_size, layout),
                group=self.group,
                max_bytes=cfg.memory_max_mb << 20,
                ttl_s=cfg.memory_ttl_hours * 3600,
            )
            if cfg.memory_interval > 0
            else None
        )
        self.first_step = True
        # A rank's own work per step, for straggler detection: wall time evens out across ranks in lock-step
        # training (the fast ones wait in the collectives), but a gloo wait blocks without using the CPU, so on CPU
        # the process's CPU time is its own work. On GPUs the work is on the device and the host waits either way:
        # wall time there (kernel timing, as NVIDIA's detector does with CUPTI, is not built).
        self.busy_clock = time.process_time if device_type == "cpu" else time.perf_counter
        self._busy0 = 0.0

    # -- resume ----------------------------------------------------------------------------------------------
    def resume(self, state: dict, ckpt) -> str:
        """Load the newest complete copy across tiers: the memory snapshot when it is at least as new as the newest
        intact storage checkpoint (and of the same layout), else storage (which reshards into any layout)."""
        mem = self.memory.latest_complete_step() if self.memory is not None else None
        stored = ckpt.committed_steps()[-1:] if ckpt is not None else []
        if mem is not None and (not stored or mem >= stored[0]):
            self.memory.restore(mem, state)
            self.event(
                "checkpoint_loaded",
                step=mem,
                source="memory",
                from_peer=bool(getattr(self.memory, "restored_from_peer", False)),
                seconds=self.memory.last_restore_s,
            )
            log.info(
                "resumed from the in-memory snapshot of step %d (%.2fs)", mem, self.memory.last_restore_s
            )
            return "memory"
        if ckpt is not None and ckpt.load_latest() is not None:
            return "storage"
        return "none"

    # -- per step ----------------------------------------------------------------------------------------------
    def step_start(self, step: int) -> None:
        self._busy0 = self.busy_clock()
        if self.watchdog is not None:
            # The first step after a (re)start compiles and warms up: give it more time.
            self.watchdog.step_started(step, self.cfg.hang_timeout_s * (5 if self.first_step else 1))
        if self.injector is not None:
            self.injector.at_step_start(step)

    def batch(self, step: int, inputs: torch.Tensor, targets: torch.Tensor):
        if self.injector is None:
            return inputs, targets
        return self.injector.corrupt_batch(step, inputs, targets, self.vocab_size)

    def loss_factor(self, step: int) -> float | None:
        return self.injector.loss_factor(step) if self.injector is not None else None

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, mean_loss) -> str:
        """'ok', 'skip' (no update this step) or 'rollback'. `mean_loss()` gives the loss averaged over data-parallel
        ranks (one small all-reduce), needed only when spike detection is on."""
        if self.nan is not None:
            decision = self.nan.check(float(loss), float(grad_norm))
            if decision != "ok":
                self.event(
                    "skipped_step",
                    step=step,
                    reason="non-finite loss or gradient",
                    skipped_total=self.nan.skipped_total,
                )
                return decision
        if self.spike is not None:
            value = float(mean_loss())
            if self.spike.observe(value):
                self.event("loss_spike", step=step, loss=value, mean=self.spike.mean, std=self.spike.std)
                return "rollback"
        return "ok"

    def skip(self, optimizers) -> None:
        skip_update(optimizers)

    def rollback(self, step: int, state: dict, ckpt, loader) -> int | None:
        """Restore the newest snapshot from before `step` and skip the batches that led here (PaLM, Chowdhery et al.
        2022: restart ~100 steps before a spike and skip the data batches in between). Returns the restored step."""
        next_sample = loader.state_dict()["next_sample"]
        source = self.resume(state, ckpt)
        if source == "none":
            log.warning("step %d: rollback requested but no snapshot exists; skipping the update only", step)
            return None
        restored = state["train"].step
        loader.load_state_dict({**loader.state_dict(), "next_sample": next_sample})  # skip the bad batches
        self.event("rollback", step=step, to_step=restored, source=source, skipped_batches=step - restored)
        log.warning(
            "step %d: rolled back to step %d (%s) and skipped %d batch(es)",
            step,
            restored,
            source,
            step - restored,
        )
        return restored

    def step_end(self, step: int, state: dict) -> None:
        if self.injector is not None:
            self.injector.at_step_end(step, self.busy_clock() - self._busy0)
        if self.straggler is not None:
            self.straggler.record(self.busy_clock() - self._busy0)
            for s in self.straggler.check(step, self.group):
                self.event("straggler", step=step, **s)
                log.warning(
                    "straggler: rank %d works %.3fs per step, %.1fx the median %.3fs",
                    s["rank"],
                    s["busy_s"],
                    s["ratio"],
                    s["median_s"],
                )
        if self.memory is not None and step % self.cfg.memory_interval == 0:
            t0 = time.perf_counter()
            if self.memory.snapshot(step, state):
                self.event(
                    "memory_snapshot",
                    step=step,
                    seconds=time.perf_counter() - t0,
                    bytes=self.memory.bytes_used(),
                )
        if self.watchdog is not None:
            self.watchdog.step_finished()
        self.first_step = False

    # -- checkpoints -------------------------------------------------------------------------------------------
    def before_save(self, step: int) -> None:
        if self.injector is not None:
            self.injector.before_checkpoint_save(step)

    def after_commit(self, step: int, path: str) -> None:
        if self.injector is not None:
            self.injector.after_checkpoint_commit(step, path)

    def close(self, success: bool) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.tracker.uninstall()
        if self.memory is not None:
            if success:
                self.memory.cleanup()
            self.memory.close()
