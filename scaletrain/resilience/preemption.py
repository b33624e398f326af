"""Preemption: SIGTERM (what Slurm, Kubernetes and torchrun send before they end a job) sets a flag, and the ranks
agree on it at a step boundary over the CPU control group, so that all of them stop after the same step (and, with
checkpoints on, save that step). Honoured with or without checkpoints. Under `scaletrain train --nproc` the
launcher's SIGTERM reaches the workers over their lifelines, which also end a worker whose launcher died; under a
torchrun of the user's own (by hand, Slurm, Kubernetes) a worker dies with its agent (follow_agent)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch.distributed as dist

from scaletrain.parallel.mesh import any_rank

log = logging.getLogger("scaletrain")


class Preemption:
    """The stop request of one start: SIGTERM, and Ctrl-C in a process of its own. A first Ctrl-C stops like
    SIGTERM (after the step, with a committed save: the same command continues the run), a second one at once (a
    KeyboardInterrupt, nothing saved). Under an elastic agent (`--nproc`, torchrun) Ctrl-C is the agent's to pass
    on, and a worker stops at once."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.flag = False
        self.received = ""  # the signal that asked for the stop, on this rank
        self._previous: dict[int, object] = {}
        # Ctrl-C: not in a worker of an elastic agent, nor where it is ignored (a shell script's background job).
        own = "LOCAL_RANK" not in os.environ and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
        with contextlib.suppress(ValueError):  # not the main thread (e.g. inside a test harness)
            for sig in (signal.SIGTERM, signal.SIGINT) if own else (signal.SIGTERM,):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.flag = True
        self.received = self.received or signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops at once
            log.warning(
                "Ctrl-C: stopping after this step and saving it (Ctrl-C again to stop at once, unsaved)"
            )

    def requested(self) -> bool:
        """True on every rank once any rank got SIGTERM (one small all-reduce on the CPU group per call)."""
        return any_rank(self.flag, self.group)

    def stopping(
        self, step: int, event: Callable[..., object], note: str, agreed: bool | None = None
    ) -> bool:
        """requested(), or `agreed` where the ranks agreed already (fault_tolerance: every replica group's), and when
        it is, the `preempted` event and the warning (`note`: what the stop saves)."""
        if not (self.requested() if agreed is None else agreed):
            return False
        received = self.received or "SIGTERM"  # another rank's, when not this one's
        event("preempted", step=step, signal=received)
        log.warning("%s: stopping after step %d (%s)", received, step, note)
        return True

    def stop_reason(self) -> str | None:
        """ "interrupted" when Ctrl-C stopped this start (its exit status is 130), else None."""
        return "interrupted" if self.received == "SIGINT" else None

    def close(self) -> None:
        """Give the signals back their previous actions: after training, a signal should end the process again."""
        with contextlib.suppress(ValueError):
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)
        self._previous = {}


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


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux; elsewhere nothing), and exit now if it already has."""
    parent = multiprocessing.parent_process()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent is not None and os.getppid() != parent.pid:
        os._exit(1)


def follow_agent() -> None:
    """In a worker of a torchrun of the user's own (by hand, the Slurm and Kubernetes recipes): end this process with
    SIGKILL when its agent dies, as `follow_launcher` does under `--nproc` (issue 41). torchrun starts each worker in
    a session of its own, so a `kill -9` of the agent (an operator, the OOM killer) would otherwise leave the workers
    training on, holding their devices and writing to the run directory, until a replacement of the same rank meets
    them. Linux: the kernel's parent-death signal (immediate, even while the worker is inside a collective);
    elsewhere (macOS) a thread that watches the parent pid every half second. A parent that died before the signal
    was set is caught by the check that follows: the adopter (init, a subreaper, a shell) is not a Python process,
    and every torch elastic agent is. Nothing is changed outside torch's agent (no TORCHELASTIC_RUN_ID) or under
    `--nproc`, whose lifelines already do this (there the parent is the fork server, not the launcher)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    # The parent is read after the signal is set: one that died in between is its adopter, which the check sees.
    armed = (
        sys.platform.startswith("linux")
        and ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    )
    agent = os.getppid()
    if not armed:
        _watch_parent(agent)
    if (adopter := _not_an_agent(agent)) is not None:
        sys.stderr.write(
            f"scaletrain: the torchrun agent that started this worker is gone (its parent is now pid "
            f"{agent}, {adopter}): exiting, so that no worker trains on without its agent\n"
        )
        os._exit(1)


def _not_an_agent(pid: int) -> str | None:
    """What process `pid` runs when it cannot be a torch elastic agent (not a Python interpreter), else None; None
    where /proc cannot say (the check then trusts the parent)."""
    try:
        exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return None
    return None if exe.startswith(("python", "pypy")) else exe


def _watch_parent(agent: int) -> None:
    def watch() -> None:
        while os.getppid() == agent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="agent-watch", daemon=True).start()
