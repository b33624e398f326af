"""Preemption: SIGTERM (what Slurm, Kubernetes and torchrun send before they end a job) sets a flag, and the ranks
agree on it at a step boundary over the CPU control group, so that all of them stop after the same step (and, with
checkpoints on, save that step). Honoured with or without checkpoints. Under `scaletrain train --nproc` the
launcher's SIGTERM reaches the workers over their lifelines, which also end a worker whose launcher died."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from multiprocessing.connection import Connection

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


class Lifelines:
    """Pipes from a `--nproc` launcher to its workers, one per local rank, whose write ends only the launcher holds.

    A message on a worker's pipe is the launcher's SIGTERM passed on: unlike a signal it needs no worker pid (the
    agent that knows them is torch's), and it waits in the pipe for a worker that is still starting. The pipe's end
    of file is the launcher's death, by any cause (`kill -9` included): the worker then kills itself, so that none
    trains on unattended into the run directory. PR_SET_PDEATHSIG cannot serve here: a worker's parent is the fork
    server, not the launcher, and the fork server outlives the launcher as long as the workers hold its "alive"
    pipe (multiprocessing.forkserver), which they do."""

    STOP = b"SIGTERM"

    def __init__(self, n: int) -> None:
        pipes = [multiprocessing.Pipe(duplex=False) for _ in range(n)]
        self.readers = tuple(r for r, _ in pipes)  # handed to the workers, which get duplicates of them
        self._writers = [w for _, w in pipes]

    def stop(self) -> None:
        """Pass SIGTERM on to every worker. Safe in a signal handler: one small write to each pipe."""
        for w in self._writers:
            with contextlib.suppress(OSError):
                w.send_bytes(self.STOP)

    def close(self) -> None:
        for c in (*self.readers, *self._writers):
            c.close()


def follow_launcher(readers: tuple[Connection, ...], local_rank: int) -> None:
    """In a worker: raise SIGTERM in this process for each stop its launcher sends, and SIGKILL it once the
    launcher is gone (the end of its lifeline). A committed checkpoint is never at risk: a save cut short has no
    commit marker and is not resumed from."""
    line = readers[local_rank]

    def follow() -> None:
        with contextlib.suppress(EOFError, OSError):
            while True:
                line.recv_bytes()
                os.kill(os.getpid(), signal.SIGTERM)  # the handler runs on the main thread: Preemption's flag
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=follow, name="launcher-lifeline", daemon=True).start()
