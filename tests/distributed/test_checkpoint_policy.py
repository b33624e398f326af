"""Saving decisions that every rank must make alike, on 2 gloo ranks (issue 21): the `auto` interval when the ranks
measure different save costs (a slow storage writer on rank 1, attached where fault injection attaches its own),
the time bound between saves when the ranks' clocks differ, and the memory tier turning off on every rank when a
write fails on one (the kernel's file size limit on rank 1). One spawn runs the phases; each rank writes what it saw,
and each test checks one phase. A rank that chose differently would wait in a collective: the spawn's timeout."""

from __future__ import annotations

import json
import resource
import shutil
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from scaletrain.checkpoint import CheckpointManager
from scaletrain.checkpoint.memory_tier import MemoryTier, make_layout_key
from scaletrain.config import CheckpointConfig
from tests.distributed.spawn import spawn
from tests.fixtures import make_state

WORLD = 2
SLOW_WRITE_S = 0.3


class SlowWriter(FileSystemWriter):
    """A storage that takes SLOW_WRITE_S longer to write this rank's files."""

    def write_data(self, plan, planner):
        time.sleep(SLOW_WRITE_S)
        return super().write_data(plan, planner)


def _train(mgr: CheckpointManager, steps: int, step_s: float = 0.02) -> None:
    mgr.load_latest()
    for step in range(1, steps + 1):
        time.sleep(step_s)  # the step's work
        mgr.maybe_save(step)


def _auto(rank: int, root: str, control, mtbf_hours: float, steps: int) -> dict:
    events: list = []
    state, *_ = make_state()
    cfg = CheckpointConfig(interval="auto", mtbf_hours=mtbf_hours, interval_minutes=0)
    mgr = CheckpointManager(cfg, root, state, rank=rank, world_size=WORLD, control=control,
                            event=lambda kind, **kw: events.append((kind, kw)))  # fmt: skip
    if rank == 1:
        mgr.make_writer = lambda path, step: SlowWriter(path)
    saves = []
    make = mgr.make_writer
    mgr.make_writer = lambda path, step: saves.append(step) or make(path, step)
    _train(mgr, steps)
    mgr.close(steps)
    chosen = [kw for kind, kw in events if kind == "checkpoint_interval"]
    return {"interval": mgr.interval, "saves": saves, "chosen": chosen}


def _time_bound(rank: int, root: str, control) -> dict:
    """Rank 1's clock runs 1.5x as fast as rank 0's: alone, it would save after step 3 and rank 0 after step 4."""
    state, *_ = make_state()
    mgr = CheckpointManager(CheckpointConfig(interval_minutes=30, async_save=False), root, state, rank=rank,
                            world_size=WORLD, control=control)  # fmt: skip
    minutes_per_step = [10.0, 15.0][rank]
    step = [0]
    mgr.clock = lambda: step[0] * minutes_per_step * 60
    saves = []
    make = mgr.make_writer
    mgr.make_writer = lambda path, s: saves.append(s) or make(path, s)
    mgr.load_latest()
    for s in range(1, 7):
        step[0] = s
        mgr.maybe_save(s)
    mgr.close(6)
    return {"saves": saves}


def _tier_failure(rank: int, shm: str, control, job: str, numel: int) -> dict:
    """Rank 1 may write no file over 64 KiB (RLIMIT_FSIZE: the kernel answers EFBIG) while rank 0 writes freely."""
    events: list = []
    state = {"x": {"t": torch.ones(numel)}}
    tier = MemoryTier(job, make_layout_key(WORLD, "test"), group=control, root=shm)
    mgr = CheckpointManager(CheckpointConfig(enabled=False), "unused", state, rank=rank, world_size=WORLD,
                            memory=tier, memory_interval=2, control=control,
                            event=lambda kind, **kw: events.append((kind, kw)))  # fmt: skip
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
    try:
        _train(mgr, 5, step_s=0.0)
        left = sorted(p.name for p in tier.job_dir.rglob("step-*"))
        mgr.close(5)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    off = [kw for kind, kw in events if kind == "memory_tier_off"]
    snaps = [kw["step"] for kind, kw in events if kind == "memory_snapshot"]
    return {"off": off, "snapshots": snaps, "left": left, "reason": tier.off}


def worker(rank: int, world_size: int, tmp: str, shm: str) -> None:
    control = dist.new_group(backend="gloo")  # the CPU control group, as ParallelDims makes it
    seen = {
        # MTBF 1000 h: an interval of ~10^5 steps, where the ranks' own figures rounded apart by hundreds of steps.
        "auto": _auto(rank, f"{tmp}/auto", control, mtbf_hours=1000.0, steps=6),
        # An MTBF of ~5 ms: an interval of a few steps, so that the run saves several times after the probe.
        "auto_often": _auto(rank, f"{tmp}/often", control, mtbf_hours=1.5e-6, steps=16),
        "time": _time_bound(rank, f"{tmp}/time", control),
        # Both ranks' snapshots are 256 KiB: rank 1's own write fails.
        "own_write": _tier_failure(rank, shm, control, "own", numel=64 << 10),
        # Rank 1's own is 4 KiB, rank 0's 256 KiB: rank 1 cannot allocate the replica of rank 0's.
        "replica": _tier_failure(rank, shm, control, "replica", numel=[64 << 10, 1 << 10][rank]),
    }
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump(seen, f)


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("policy")
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp
    shm = base / f"scaletrain-test-{uuid.uuid4().hex[:12]}"
    try:
        spawn(worker, WORLD, str(tmp), str(shm), timeout=180)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_auto_interval_is_the_same_on_every_rank(seen):
    """Each rank measured its own save (rank 1's writer is slow); the interval comes from the slowest figures,
    agreed over the control group. Before issue 21 each rank rounded its own: 82203 and 82696 steps."""
    intervals = [s["auto"]["interval"] for s in seen]
    assert intervals[0] == intervals[1] > 1000, intervals
    chosen = seen[0]["auto"]["chosen"]
    assert (
        len(chosen) == 1
        and chosen[0]["cost_s"] >= SLOW_WRITE_S
        and chosen[0]["interval_steps"] == intervals[0]
    )
    assert [s["auto"]["saves"] for s in seen] == [[5, 6], [5, 6]]  # the probe, then the final save


def test_auto_interval_saves_at_the_same_steps_on_every_rank(seen):
    runs = [s["auto_often"] for s in seen]
    assert runs[0]["interval"] == runs[1]["interval"] <= 5, runs
    assert runs[0]["saves"] == runs[1]["saves"] and len(runs[0]["saves"]) >= 3, runs


def test_the_time_bound_is_decided_together(seen):
    """The rank whose clock says 30 minutes first decides for both: both save after step 3, then after step 5."""
    assert [s["time"]["saves"] for s in seen] == [[3, 5, 6], [3, 5, 6]]


@pytest.mark.parametrize("phase", ["own_write", "replica"])
def test_a_write_failing_on_one_rank_turns_the_memory_tier_off_on_every_rank(seen, phase):
    """The first snapshot (step 2) fails on rank 1 only: EFBIG writing its own file, or allocating the replica of
    rank 0's. Both ranks turn the tier off at step 2 with rank 1's error, remove the step's partial files and
    train on; nothing waits for a peer that gave up. Before issue 21 rank 1's SafetensorError escaped and rank 0
    waited for it in the replication."""
    runs = [s[phase] for s in seen]
    for r in runs:
        assert [o["step"] for o in r["off"]] == [2], r
        assert "failed on rank 1" in r["off"][0]["reason"] and "File too large" in r["off"][0]["reason"], r
        assert r["snapshots"] == [] and r["left"] == [], r
        assert "checkpoint.snapshot_interval = 0" in r["reason"]
