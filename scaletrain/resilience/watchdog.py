"""Hang detection: a watchdog thread that, when a step overruns its timeout, writes every thread's stack and the
last collective this rank entered (from torch's flight recorder) to the run directory, then ends the process so the
elastic agent restarts it."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import pickle
import sys
import threading
import time
from pathlib import Path
from typing import Any

from scaletrain.metrics.writer import append_event

log = logging.getLogger("scaletrain")

HANG_EXIT_CODE = 86
"""Exit status of a worker the watchdog ended. torchrun's agent sees a failed worker and restarts the group (within
resilience.max_restarts); the launcher's diagnosis (resilience.diagnose) reads this status to report "hang" rather
than "crash" for that rank."""


class Watchdog:
    """Ends this process when a step runs longer than `timeout_s`, after writing why.

    A hung collective (a dead peer, a rank on another code path) blocks every rank forever, and NCCL's own timeout
    only covers GPU collectives and by default takes 10 minutes or more. On expiry it writes
    <run_dir>/hang-rank{rank}.txt (every thread's Python stack and the last collective), appends a "hang" event to
    <run_dir>/events.jsonl, and exits with HANG_EXIT_CODE so that torchrun's agent restarts the group from the
    newest checkpoint. Time between steps (evaluation, checkpoints) is not watched unless bracketed as a step.

    The last collective comes from torch's flight recorder, which c10d keeps for every process group (gloo and
    NCCL), so it sees the collectives DDP, FSDP2 and DTensor issue from C++ too. Its whole dump (torch's pickle: the
    recent collectives of every group with the Python stack that issued each) goes to
    <run_dir>/flight_recorder/rank{rank}; comparing the ranks' sequence numbers per group names the rank the others
    wait for. (torch's own analyser, `python -m torch.distributed.flight_recorder.fr_trace DIR --prefix rank`, stops
    on gloo dumps with torch 2.13: they lack the group table it reads.)
    """

    def __init__(self, timeout_s: float, run_dir: Path, rank: int) -> None:
        if not timeout_s > 0:
            raise ValueError(f"watchdog timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self.run_dir = Path(run_dir)
        self.rank = rank
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
        self.run_dir.mkdir(parents=True, exist_ok=True)
        last = _last_collective(self.run_dir / "flight_recorder" / f"rank{self.rank}")
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


def _last_collective(dump_to: Path) -> dict[str, Any] | None:
    """The collective this rank waits in, from torch's flight recorder: the newest one not yet finished, else the
    newest one entered. {"name", "group", "seq", "in_flight", "seconds_ago", "issued_at"}; the recorder's whole dump
    is written to `dump_to`. None when the recorder holds nothing (no process group,
    TORCH_FR_BUFFER_SIZE=0) or this torch has no dump call: a hang report must come out whatever fails here."""
    try:
        # The retrieval call torch's flight-recorder tutorial documents (a private name; absent in old torch).
        from torch._C._distributed_c10d import _dump_fr_trace

        dump = _dump_fr_trace(True, True, False)  # collectives with their Python stacks; finished ones too
        entries = pickle.loads(dump).get("entries") or []
        if entries:
            dump_to.parent.mkdir(parents=True, exist_ok=True)
            dump_to.write_bytes(dump)
    except Exception as e:  # an old torch, a backend without a recorder: the stacks still name where it waits
        log.warning("no flight-recorder record of the last collective: %s", e)
        return None
    if not entries:
        return None
    # The newest entry is not always the stuck one: a background thread (the async checkpoint's commit barrier) may
    # have entered and left a collective after the training thread blocked in DDP's gradient all-reduce.
    waiting = [e for e in entries if not e.get("retired", True)]
    e = max(waiting or entries, key=lambda x: x["time_created_ns"])
    ours = [f for f in e.get("frames", []) if "scaletrain" in f.get("filename", "")]
    return {
        "name": e["profiling_name"],  # e.g. "gloo:barrier", "nccl:all_reduce"
        "group": e["process_group"][1] or e["process_group"][0],
        "seq": e["p2p_seq_id"] if e["is_p2p"] else e["collective_seq_id"],
        "in_flight": bool(waiting),
        "seconds_ago": round(time.time() - e["time_created_ns"] / 1e9, 3),
        "issued_at": f"{ours[0]['filename']}:{ours[0]['line']} {ours[0]['name']}" if ours else None,
    }


_exit = os._exit  # module-level so an in-process test can observe the exit instead of dying
