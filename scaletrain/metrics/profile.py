"""profile.steps: a torch.profiler trace of chosen steps on chosen ranks (Chrome/Perfetto JSON) and a summary of
it (top ops by self time, communication vs compute time, their overlap), plus CUDA memory snapshots.

Overlap is measured on the trace's own intervals. Communication: every event whose name says it is a collective
or point-to-point transfer (gloo:*, nccl*, c10d::*, all_reduce, all_gather, reduce_scatter, broadcast, send,
recv, all_to_all). Compute: on CUDA the other GPU kernels; on CPU the outermost aten:: ops of each thread (not
inside another aten op or a communication event, so a collective's own copies are not compute). overlap fraction
= |comm ∩ compute| / |comm| over the unions of each set's intervals: 1 means every moment of communication ran
beside compute (hidden), 0 that none did."""

from __future__ import annotations

import json
import logging
import re
import time
from collections import defaultdict
from pathlib import Path

import torch

from scaletrain.config import ProfileConfig

log = logging.getLogger("scaletrain")

Interval = tuple[float, float]
_COMM = re.compile(
    r"gloo|nccl|c10d|all_?reduce|all_?gather|reduce_?scatter|broadcast|all_?to_?all|\bsend\b|\brecv\b|"
    r"isend|irecv|send_?recv",
    re.IGNORECASE,
)
_STEPS = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")


def parse_steps(text: str) -> tuple[int, int] | None:
    """'10-12' -> (10, 12), '7' -> (7, 7), '' -> None; anything else is a ValueError naming the forms."""
    if not text.strip():
        return None
    m = _STEPS.fullmatch(text)
    first, last = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
    if not m or first < 1 or last < first:
        raise ValueError(
            f"profile.steps '{text}' must be 'A-B' (1 <= A <= B) or one step 'N', e.g. \"10-12\""
        )
    return first, last


def profile_problems(cfg: ProfileConfig, steps: int, world_size: int, cuda: bool) -> list[str]:
    try:
        span = parse_steps(cfg.steps)
    except ValueError as e:
        return [str(e)]
    problems = []
    if span is not None and span[1] > steps:
        problems.append(
            f"profile.steps '{cfg.steps}' ends after training.steps {steps}; profile earlier steps"
        )
    if bad := [r for r in cfg.ranks if not 0 <= r < world_size]:
        problems.append(
            f"profile.ranks {bad} are not ranks of a world of {world_size}; use 0..{world_size - 1}"
        )
    if cfg.memory and not cuda:
        problems.append("profile.memory records the CUDA allocator's history; it needs a CUDA device")
    if cfg.memory and span is None:
        problems.append("profile.memory needs profile.steps (the snapshot is taken after those steps)")
    return problems


# -- Intervals ------------------------------------------------------------------------------------------------


def merge(intervals: list[Interval]) -> list[Interval]:
    """The union of intervals as sorted, disjoint intervals (empty ones dropped)."""
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(merged: list[Interval]) -> float:
    return sum(e - s for s, e in merged)


def intersection(a: list[Interval], b: list[Interval]) -> float:
    """Total length of the intersection of two merged (sorted, disjoint) interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_fraction(comm: list[Interval], compute: list[Interval]) -> float | None:
    """|comm ∩ compute| / |comm| over the unions; None when there is no communication."""
    c = merge(comm)
    total = length(c)
    return intersection(c, merge(compute)) / total if total > 0 else None


def is_comm(name: str) -> bool:
    return bool(_COMM.search(name))


def classify(events: list[dict]) -> tuple[list[Interval], list[Interval]]:
    """(communication, compute) intervals in microseconds from Chrome trace events, by the module's rule."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in spans if e.get("cat") == "kernel"]
    if kernels:  # the device's timeline: NCCL kernels against the others (CPU-side launches are not the work)
        comm = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if is_comm(e["name"])]
        return comm, [(e["ts"], e["ts"] + e["dur"]) for e in kernels if not is_comm(e["name"])]
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in spans if is_comm(e["name"])]
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in spans:
        if e["name"].startswith("aten::") or is_comm(e["name"]):
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    compute = []
    for evs in by_thread.values():
        open_ends: list[float] = []  # ends of the enclosing events, innermost last
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= e["ts"]:
                open_ends.pop()
            end = e["ts"] + e["dur"]
            if not open_ends and not is_comm(e["name"]):
                compute.append((e["ts"], end))
            open_ends.append(end)
    return comm, compute


def summarize(events: list[dict], top_ops: list[dict], steps: tuple[int, int]) -> dict:
    comm, compute = classify(events)
    c, k = merge(comm), merge(compute)
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and "dur" in e]
    window = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0
    return {
        "steps": list(steps),
        "window_s": window / 1e6,
        "compute_s": length(k) / 1e6,
        "comm_s": length(c) / 1e6,
        "overlap_s": intersection(c, k) / 1e6,
        "overlap_fraction": overlap_fraction(comm, compute),
        "top_ops": top_ops,
    }


def format_summary(s: dict) -> str:
    frac = "n/a (no communication)" if s["overlap_fraction"] is None else f"{s['overlap_fraction']:.1%}"
    lines = [
        f"profile of steps {s['steps'][0]}-{s['steps'][1]}: {s['window_s']:.3f} s traced; compute "
        f"{s['compute_s']:.3f} s, communication {s['comm_s']:.3f} s, overlapped {s['overlap_s']:.3f} s "
        f"(overlap fraction {frac})",
        f"{'op':48s} {'calls':>7s} {'self ms':>10s}",
    ]
    lines += [f"{o['name'][:48]:48s} {o['count']:7d} {o['self_ms']:10.2f}" for o in s["top_ops"]]
    return "\n".join(lines)


# -- The profiler -----------------------------------------------------------------------------------------------


class Profiler:
    """Started at the first profiled step's start and stopped at the last one's end, on the chosen ranks only
    (the others do nothing). Writes <run>/profile/rank{r}.trace.json, .summary.json and .summary.txt."""

    def __init__(self, cfg: ProfileConfig, run_dir: Path, rank: int, device: torch.device) -> None:
        self.span = parse_steps(cfg.steps)
        self.enabled = self.span is not None and rank in cfg.ranks
        self.dir, self.rank, self.cuda = Path(run_dir) / "profile", rank, device.type == "cuda"
        self.prof: torch.profiler.profile | None = None
        self.done = False
        self.memory = self.enabled and cfg.memory and self.cuda
        if self.memory:
            self.dir.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            # Called by the allocator when it is out of memory, before the error is raised.
            torch._C._cuda_attach_out_of_memory_observer(lambda *_: self._snapshot("oom"))

    def step_start(self, step: int) -> None:
        if not self.enabled or self.done or self.prof is not None or not self.span[0] <= step <= self.span[1]:
            return
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=acts)
        self.prof.start()
        self.first = step

    def step_end(self, step: int) -> float:
        """After the last profiled step: stop, write the trace and the summary; returns the seconds that took."""
        if self.prof is None or step < self.span[1]:
            return 0.0
        t0 = time.perf_counter()
        if self.cuda:
            torch.cuda.synchronize()
        self.prof.stop()
        self.done = True
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / f"rank{self.rank}.trace.json"
        self.prof.export_chrome_trace(str(trace))
        summary = summarize(json.loads(trace.read_text())["traceEvents"], self._top_ops(), (self.first, step))
        (self.dir / f"rank{self.rank}.summary.json").write_text(json.dumps(summary, indent=1))
        text = format_summary(summary)
        (self.dir / f"rank{self.rank}.summary.txt").write_text(text + "\n")
        log.info("rank %d: profiler trace %s\n%s", self.rank, trace, text)
        self.prof = None
        if self.memory:
            self._snapshot("memory")
        return time.perf_counter() - t0

    def _top_ops(self, n: int = 12) -> list[dict]:
        attr = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        ops = sorted(self.prof.key_averages(), key=lambda a: getattr(a, attr), reverse=True)[:n]
        return [{"name": a.key, "count": a.count, "self_ms": getattr(a, attr) / 1e3} for a in ops]

    def _snapshot(self, kind: str) -> None:
        path = self.dir / f"rank{self.rank}.{kind}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        log.warning("rank %d: CUDA memory snapshot %s (open it at pytorch.org/memory_viz)", self.rank, path)
