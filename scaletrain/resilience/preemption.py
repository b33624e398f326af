"""Preemption: SIGTERM (what Slurm, Kubernetes and torchrun send before they end a job) sets a flag, and the ranks
agree on it at a step boundary over the CPU control group, so that all of them stop after the same step (and, with
checkpoints on, save that step). Honoured with or without checkpoints."""

from __future__ import annotations

import contextlib
import signal

import torch.distributed as dist

from scaletrain.parallel.mesh import any_rank


class Preemption:
    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.flag = False
        self._previous = None
        with contextlib.suppress(ValueError):  # not the main thread (e.g. inside a test harness)
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.flag = True

    def requested(self) -> bool:
        """True on every rank once any rank got SIGTERM (one small all-reduce on the CPU group per call)."""
        return any_rank(self.flag, self.group)

    def close(self) -> None:
        """Give SIGTERM back its previous action: after training, a SIGTERM should end the process again."""
        if self._previous is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
