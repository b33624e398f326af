"""What keeps a step healthy: the hang watchdog, NaN and loss-spike checks with the rollback decision, straggler
detection, and the per-step hooks of fault injection. The loop calls `step_start`, `check`, `step_end`; restoring
a snapshot is the checkpoint manager's (`load_latest`), deciding to is the guard's."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from scaletrain.config import ResilienceConfig
from scaletrain.parallel.mesh import DistEnv
from scaletrain.resilience.busy import BusyClock, clock_for
from scaletrain.resilience.faults import FaultInjector
from scaletrain.resilience.health import Decision, NanGuard, SpikeDetector
from scaletrain.resilience.straggler import StragglerMonitor
from scaletrain.resilience.watchdog import Watchdog

log = logging.getLogger("scaletrain")


class Guard:
    def __init__(
        self,
        cfg: ResilienceConfig,
        run_dir: Path,
        env: DistEnv,
        group: dist.ProcessGroup | None,
        event: Callable[..., None],
        mean_loss: Callable[[torch.Tensor], torch.Tensor],
        faults: FaultInjector | None = None,
        clock: BusyClock | None = None,
    ):
        rank, device_type = env.rank, env.device.type
        self.cfg = cfg
        self.event = event
        self.group = group  # the CPU control group: straggler times are gathered over it
        self.mean_loss = (
            mean_loss  # the loss averaged over data-parallel ranks (spike detection decides alike)
        )
        self.faults = faults
        self.watchdog = Watchdog(cfg.hang_timeout_s, run_dir, rank) if cfg.hang_timeout_s > 0 else None
        self.nan = NanGuard(cfg.nan_rollback_after) if cfg.nan_check else None
        self.spike = SpikeDetector(cfg.spike_window, cfg.spike_zscore) if cfg.spike_zscore > 0 else None
        self.straggler = (
            StragglerMonitor(cfg.straggler_factor, cfg.straggler_interval)
            if cfg.straggler_factor > 0
            else None
        )
        self.first_step = True
        # A rank's own work per step, for straggler detection (resilience/busy.py): CPU time on CPU, CUDA events
        # around the step's compute on a GPU; the step runner brackets its compute on `clock`.
        self.clock: BusyClock = clock if clock is not None else clock_for(device_type)
        # Host time for fault injection's slowdowns (a spin burns host time): CPU time on CPU, else wall time.
        self.busy_clock = time.process_time if device_type == "cpu" else time.perf_counter
        self._busy0 = 0.0

    def step_start(self, step: int) -> None:
        self._busy0 = self.busy_clock()
        self.clock.step_start()
        if self.watchdog is not None:
            # The first step after a (re)start compiles and warms up: give it more time.
            self.watchdog.step_started(step, self.cfg.hang_timeout_s * (5 if self.first_step else 1))
        if self.faults is not None:
            self.faults.at_step_start(step)

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> Decision:
        """'ok', 'skip' (no update this step) or 'rollback' (restore the newest snapshot). The grad norm is global
        (the same on every rank) and spikes are judged on the data-parallel mean: every rank decides alike.

        Everything the checks need is copied to the host in one transfer: on a GPU that is the step's only
        device sync outside logging steps (two float() calls used to make two)."""
        if self.nan is None and self.spike is None:
            return "ok"
        values = [loss, grad_norm] + ([self.mean_loss(loss)] if self.spike is not None else [])
        host = torch.stack([v.detach().float().reshape(()) for v in values]).tolist()
        if self.nan is not None:
            decision = self.nan.check(host[0], host[1])
            if decision != "ok":
                self.event(
                    "skipped_step",
                    step=step,
                    reason="non-finite loss or gradient",
                    skipped_total=self.nan.skipped_total,
                )
                return decision
        if self.spike is not None and self.spike.observe(host[2]):
            self.event("loss_spike", step=step, loss=host[2], mean=self.spike.mean, std=self.spike.std)
            return "rollback"
        return "ok"

    def rollback(self, step: int, ckpt, loader) -> int | None:
        """Restore the newest snapshot from before `step` and skip the batches that led here (PaLM, Chowdhery et al.
        2022: restart ~100 steps before a spike and skip the data batches in between). Returns the restored step,
        None when there is no snapshot (the step's update is then only skipped)."""
        next_sample = loader.state_dict()["next_sample"]
        restored = ckpt.load_latest()
        if restored is None:
            log.warning("step %d: rollback requested but no snapshot exists; skipping the update only", step)
            return None
        loader.load_state_dict({**loader.state_dict(), "next_sample": next_sample})  # skip the bad batches
        self.event(
            "rollback", step=step, to_step=restored, source=ckpt.last_source, skipped_batches=step - restored
        )
        log.warning(
            "step %d: rolled back to step %d (%s) and skipped %d batch(es)",
            step,
            restored,
            ckpt.last_source,
            step - restored,
        )
        return restored

    def step_end(self, step: int) -> None:
        if self.faults is not None:
            self.faults.at_step_end(step, self.busy_clock() - self._busy0, self.busy_clock)
        busy = self.clock.step_end()  # after the faults' slowdown: a slowed CPU rank counts it
        if self.straggler is not None:
            for seconds in busy:
                self.straggler.record(seconds)
            for s in self.straggler.check(step, self.group):
                self.event("straggler", step=step, **s)
                log.warning(
                    "straggler: rank %d works %.3fs per step, %.1fx the median %.3fs",
                    s["rank"],
                    s["busy_s"],
                    s["ratio"],
                    s["median_s"],
                )
        if self.watchdog is not None:
            self.watchdog.step_finished()
        self.first_step = False

    def close(self) -> None:
        """Stop the watchdog (the final save after the loop is the checkpoint manager's to protect)."""
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
