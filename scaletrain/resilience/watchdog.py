"""Hang detection: a watchdog thread that, when a step overruns its timeout, writes every thread's stack and the
last collective this rank entered to the run directory, then ends the process so the elastic agent restarts it."""

from __future__ import annotations

import faulthandler
import functools
import inspect
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scaletrain.metrics.writer import append_event

log = logging.getLogger("scaletrain")

HANG_EXIT_CODE = 86
"""Exit status of a worker the watchdog ended. torchrun's agent sees a failed worker and restarts the group (within
resilience.max_restarts); the launcher's diagnosis (resilience.diagnose) reads this status to report "hang" rather
than "crash" for that rank."""

TRACKED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "all_to_all_single",
)


class CollectiveTracker:
    """Remembers the last collective this rank entered, by wrapping the `torch.distributed` functions in TRACKED.

    Comparing ranks' records names the hang: the rank whose count is behind, or that sits in a different collective,
    is the one the others wait for. Only calls through the `torch.distributed` namespace are seen: DTensor and
    FSDP2 issue functional collectives (`torch.distributed._functional_collectives`, c10d ops) and DDP its bucketed
    all-reduces from C++, which all bypass these wrappers; so do names imported before `install()`
    (`from torch.distributed import all_reduce`).
    """

    def __init__(self) -> None:
        self.last: dict[str, Any] | None = None
        """{"name", "group_size", "time" (wall clock), "count"} of the newest collective entered, or None."""
        self.count = 0
        """Collectives entered since install()."""
        self._originals: dict[str, Callable] = {}

    def install(self) -> None:
        import torch.distributed as dist

        for name in TRACKED:
            fn = getattr(dist, name, None)
            if fn is not None and name not in self._originals:
                self._originals[name] = fn
                setattr(dist, name, self._wrap(name, fn))

    def uninstall(self) -> None:
        import torch.distributed as dist

        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()

    def _wrap(self, name: str, fn: Callable) -> Callable:
        params = list(inspect.signature(fn).parameters)
        group_at = params.index("group") if "group" in params else None

        @functools.wraps(fn)
        def tracked(*args: Any, **kwargs: Any) -> Any:
            self._enter(name, args, kwargs, group_at)
            return fn(*args, **kwargs)

        return tracked

    def _enter(self, name: str, args: tuple, kwargs: dict, group_at: int | None) -> None:
        import torch.distributed as dist

        group = kwargs.get("group")
        if group is None and group_at is not None and len(args) > group_at:
            group = args[group_at]
        if name == "batch_isend_irecv":
            ops = kwargs.get("p2p_op_list", args[0] if args else None)
            group = getattr(ops[0], "group", None) if ops else None
        try:
            size = dist.get_world_size(group) if dist.is_initialized() else None
        except Exception:  # never let bookkeeping break the collective itself
            size = None
        self.count += 1
        self.last = {"name": name, "group_size": size, "time": time.time(), "count": self.count}


class Watchdog:
    """Ends this process when a step runs longer than `timeout_s`, after writing why.

    A hung collective (a dead peer, a rank on another code path) blocks every rank forever, and NCCL's own timeout
    only covers GPU collectives and by default takes 10 minutes or more. On expiry it writes
    <run_dir>/hang-rank{rank}.txt (every thread's Python stack and the last collective), appends a "hang" event to
    <run_dir>/events.jsonl, and exits with HANG_EXIT_CODE so that torchrun's agent restarts the group from the
    newest checkpoint. Time between steps (evaluation, checkpoints) is not watched unless bracketed as a step.
    """

    def __init__(
        self, timeout_s: float, run_dir: Path, rank: int, tracker: CollectiveTracker | None = None
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"watchdog timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.tracker = tracker
        self._lock = threading.Lock()
        self._step: int | None = None
        self._started: float | None = None
        self._limit = timeout_s
        self._stop = threading.Event()
        # Poll often enough to fire within ~10% of the timeout, but not busily.
        self._poll = min(1.0, max(0.01, timeout_s / 10))
        self._thread = threading.Thread(target=self._run, name="scaletrain-watchdog", daemon=True)
        self._thread.start()

    def step_started(self, step: int, timeout_s: float | None = None) -> None:
        """Start the clock for `step`; `timeout_s` overrides the limit for this step only (e.g. a first step that
        compiles or warms up, or a bracketed checkpoint save)."""
        with self._lock:
            self._step, self._started = step, time.monotonic()
            self._limit = timeout_s if timeout_s is not None else self.timeout_s

    def step_finished(self) -> None:
        with self._lock:
            self._started = None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            with self._lock:
                step, started, limit = self._step, self._started, self._limit
            if started is not None and time.monotonic() - started > limit:
                self._fire(step, time.monotonic() - started, limit)
                return

    def _fire(self, step: int | None, elapsed: float, limit: float) -> None:
        last = dict(self.tracker.last) if self.tracker is not None and self.tracker.last else None
        if last is not None:
            last["seconds_ago"] = round(time.time() - last["time"], 3)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        stacks = self.run_dir / f"hang-rank{self.rank}.txt"
        with open(stacks, "w") as f:
            f.write(
                f"scaletrain watchdog: rank {self.rank}, step {step} has run {elapsed:.1f}s "
                f"(timeout {limit:g}s)\n"
            )
            f.write(f"last collective entered: {json.dumps(last)}\n")
            f.write("Python stacks of every thread (this watchdog thread included):\n\n")
            f.flush()  # faulthandler writes to the descriptor directly, after what we buffered
            faulthandler.dump_traceback(f, all_threads=True)
        append_event(
            self.run_dir,
            "hang",
            step,
            rank=self.rank,
            timeout_s=limit,
            elapsed_s=round(elapsed, 3),
            last_collective=last,
            stacks_file=str(stacks),
        )
        log.error(
            "rank %d: step %s exceeded the %gs watchdog timeout; stacks in %s; exiting with %d",
            self.rank,
            step,
            limit,
            stacks,
            HANG_EXIT_CODE,
        )
        sys.stderr.flush()
        # os._exit, not sys.exit: the main thread is stuck (in C++, a lock, a collective) and would never run the
        # cleanup sys.exit waits for.
        _exit(HANG_EXIT_CODE)


_exit = os._exit  # module-level so an in-process test can observe the exit instead of dying
