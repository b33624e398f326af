"""What keeps a step healthy: the hang watchdog, NaN and loss-spike checks with the rollback decision, straggler
detection, silent-data-corruption checks (resilience/sdc.py), and the per-step hooks of fault injection. The loop
calls `step_start`, `check`, `after_update`, `step_end`; restoring a snapshot is the checkpoint manager's
(`load_latest`), deciding to is the guard's. resilience_problems checks resilience.* before launch."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.config import ResilienceConfig
from scaletrain.errors import UserError
from scaletrain.parallel.mesh import DistEnv
from scaletrain.resilience.busy import BusyClock, clock_for
from scaletrain.resilience.faults import FaultInjector, validate_specs
from scaletrain.resilience.health import Decision, NanGuard, SpikeDetector
from scaletrain.resilience.sdc import Finding, SdcCheck, exclude_hosts
from scaletrain.resilience.straggler import StragglerMonitor, describe
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
        parts: list[nn.Module] | None = None,
        updates_each_replica: bool = True,
        nodes: dict[str, dict] | None = None,
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
            StragglerMonitor(cfg.straggler_factor, cfg.straggler_interval, nodes)
            if cfg.straggler_factor > 0
            else None
        )
        self.run_dir = run_dir
        self.rank = rank
        # resilience.sdc_interval: fingerprints of the parameters `parts` this rank holds, compared over `group`;
        # all of them watched at rest when their replicas do not each compute the update (layout.updates_each_replica).
        watch = dict(watch_all=not updates_each_replica, spikes=self.spike is not None)
        self.sdc = (
            SdcCheck(cfg.sdc_interval, parts or [], rank, group, **watch) if cfg.sdc_interval > 0 else None
        )
        # With sdc on, a grad-norm spike (judged like the loss's) also asks whether a device computed it.
        self.grad_spike = (
            SpikeDetector(cfg.spike_window, cfg.spike_zscore) if self.sdc is not None and self.spike else None
        )
        # The pending rollback is for corruption: the data is innocent, nothing skipped.
        self._sdc_rollback = False
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
        device sync outside logging steps (two float() calls used to make two).

        resilience.sdc_interval: the slices no other rank holds are compared with what the last update wrote (on
        the device: the next check reads it)."""
        if self.sdc is not None:
            self.sdc.observe(step)  # this step's logits fingerprint, kept for a replay
            self.sdc.watch()
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
            # The device or the data? Rolled back either way; the data's batches are skipped.
            if self.sdc is not None:
                self._sdc_on_spike(step, "loss_spike")
            return "rollback"
        if self.grad_spike is not None and self.grad_spike.observe(host[1]):
            g = self.grad_spike
            self.event("grad_norm_spike", step=step, grad_norm=host[1], mean=g.mean, std=g.std)
            # A device's: roll back. The data's: the update goes on, bounded by clipping (optimizer.grad_clip).
            return "rollback" if self._sdc_on_spike(step, "grad_norm_spike") else "ok"
        return "ok"

    def _sdc_on_spike(self, step: int, where: str) -> bool:
        """A spike with sdc on: did a device cause it? Replicas that differ now say so; else the step's forward is
        replayed on each rank and its buddy (same batches, same weights) and compared bitwise. True: corruption
        found (reported, a rollback without skipping data pending)."""
        self.sdc.record(step)
        if self._sdc_verify(step, where) == "rollback":
            self.event("spike_cause", step=step, spike=where, cause="device", replayed=False)
            return True
        finding = self.sdc.replay_on_buddy(step)
        replayed = self.sdc.buddy_reports is not None
        self.event("spike_cause", step=step, spike=where, cause="data" if finding is None else "device",
                   replayed=replayed)  # fmt: skip
        if finding is None:
            log.warning("step %d: %s with identical replicas%s: the data's", step, where,
                        " and logits reproduced on each rank's buddy" if replayed else "")  # fmt: skip
            return False
        finding.where = where
        self._sdc_found(finding)
        return True

    def after_update(self, step: int, decision: Decision) -> Decision:
        """After the optimizer step (before the step's snapshot): record the fingerprints of the slices no other
        rank holds; on a check step, record all of this rank's and verify them across replicas. The bitflip fault
        fires in between (corruption of the freshly updated weights). Returns `decision`, or 'rollback' on a
        finding."""
        if self.sdc is not None and decision == "rollback":
            self.sdc.reset()  # the snapshot's weights come back: nothing recorded holds for them
        due = self.sdc is not None and decision == "ok" and self.sdc.due(step)
        if self.sdc is not None and decision == "ok":
            self.sdc.rested()  # a skipped step changed nothing: the last record still holds
        if due:
            self.sdc.record(step)
        if self.faults is not None:
            self.faults.after_update(step)
        if due and self._sdc_verify(step, "after_update") == "rollback":
            return "rollback"
        return decision

    def _sdc_verify(self, step: int, where: str) -> Decision:
        """One comparison over the control group: 'rollback' on a finding, else 'ok'. A replay that reached the step
        of the finding it was to attribute reports its verdict; replicas that still differ then stop the run."""
        finding = self.sdc.verify(step, where)
        verdict = self.sdc.replayed()
        if verdict is not None:
            self._report(verdict)
            if finding is not None:
                fields = finding.event_fields()
                raise UserError(
                    f"step {step}: the replicas still differ after rolling back and replaying the steps (ranks "
                    f"{fields['ranks']}: {fields['params']}): the corruption is not transient; the run stops. "
                    "Take the named hosts out of the job"
                )
            return "ok"
        return self._sdc_found(finding) if finding is not None else "ok"

    def _sdc_found(self, finding: Finding) -> Decision:
        """Roll back. An attributed finding is reported now; an unattributed one (two replicas disagree) when the
        replay of its steps from the snapshot names the rank."""
        self._sdc_rollback = True
        if finding.attributed:
            self._report(finding)
        else:
            log.error(
                "step %d: replicas differ (ranks %s: %s); rolling back and replaying the steps since the last check "
                "to tell which rank computed wrong",
                finding.step,
                sorted(finding.params),
                finding.event_fields()["params"],
            )
            self.sdc.suspect(finding)
        return "rollback"

    def _report(self, finding: Finding) -> None:
        """The event (rank 0 writes it), the log line, the host marked with resilience.sdc_exclude."""
        fields = finding.event_fields()
        self.event("sdc_detected", step=finding.step, **fields)
        log.error(
            "step %d: silent data corruption on rank(s) %s (%s): %s",
            finding.step,
            fields["ranks"],
            ", ".join(f"rank {r}: {h}" for r, h in fields["how"].items()),
            fields["params"],
        )
        if self.cfg.sdc_exclude and self.rank == 0 and finding.attributed:
            path = exclude_hosts(self.run_dir, fields["hosts"], finding.step)
            log.error("host(s) %s marked bad in %s: a restart leaves them out", fields["hosts"], path)

    def rollback(self, step: int, ckpt, loader) -> int | None:
        """Restore the newest snapshot from before `step` and skip the batches that led here (PaLM, Chowdhery et al.
        2022: restart ~100 steps before a spike and skip the data batches in between). Returns the restored step,
        None when there is no snapshot (the step's update is then only skipped).

        After silent data corruption the batches are innocent: the snapshot's data position is kept, so the steps
        since are replayed on the same data (a deterministic run ends as if nothing happened); without a snapshot
        the corrupted weights cannot be undone and the run stops (UserError)."""
        if self.sdc is not None:
            self.sdc.reset()
        if self._sdc_rollback:
            self._sdc_rollback = False
            return self._sdc_restore(step, ckpt)
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

    def _sdc_restore(self, step: int, ckpt) -> int:
        restored = ckpt.load_latest()
        if restored is None:
            raise UserError(
                f"silent data corruption found at step {step} and no snapshot predates it, so the corrupted weights "
                "cannot be undone; the run stops (see the sdc_detected event). Take snapshots "
                "(checkpoint.snapshot_interval or checkpoint.interval, a multiple of resilience.sdc_interval)"
            )
        self.event("rollback", step=step, to_step=restored, source=ckpt.last_source, skipped_batches=0,
                   reason="sdc")  # fmt: skip
        log.warning(
            "step %d: rolled back to step %d (%s); replaying its steps", step, restored, ckpt.last_source
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
                log.warning(describe(s))
        if self.watchdog is not None:
            self.watchdog.step_finished()
        self.first_step = False

    def close(self) -> None:
        """Stop the watchdog (the final save after the loop is the checkpoint manager's to protect)."""
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None


def resilience_problems(r: ResilienceConfig, world_size: int | None) -> list[str]:
    """resilience.*: the fault specs (with `world_size`, also their ranks), restarts, the hang timeout and the
    straggler factor."""
    problems = validate_specs(r.inject, world_size)
    if min(r.max_restarts, r.hang_timeout_s) < 0:
        problems.append("resilience.max_restarts and hang_timeout_s must be >= 0")
    if r.straggler_factor and r.straggler_factor <= 1:
        problems.append(
            "resilience.straggler_factor must be > 1 (a multiple of the median step time), or 0 (off)"
        )
    return problems
