"""Recovery cost, like for like: one state restored into the same live objects from three places, each checked
three ways (none, CRC32, sha256), the whole wait a restarted worker sees (find the newest copy, check it, fill the
state). The places: the in-memory tier (safetensors in /dev/shm, its format today), DCP files in /dev/shm (the
format the tier could use instead, so memory snapshots would reshard like storage checkpoints), and a storage
checkpoint (DCP on local disk, through CheckpointManager), read from the page cache (warm: the best case for
storage) and from the disk (cold: its pages dropped first). Rounds interleave the variants, rotating their order,
so noise from other processes on the machine spreads evenly; each figure is a median with its min-max.

    python benchmarks/recovery.py [--preset 125M] [--vocab 32000] [--rounds 5] [--threads 2]
    python benchmarks/recovery.py --drill-steps 1200 --drill-every 400   # goodput drill, ~11 min
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import fsspec
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemWriter

from scaletrain.checkpoint import (
    CheckpointManager,
    LoaderState,
    ModelState,
    TrainState,
    integrity,
    memory_tier,
)
from scaletrain.checkpoint import manager as manager_module
from scaletrain.checkpoint.memory_tier import MemoryTier, default_root, file_crc32, make_layout_key
from scaletrain.checkpoint.safe_load import make_reader, read_metadata
from scaletrain.config import CheckpointConfig, ModelConfig, OptimizerConfig
from scaletrain.models import build_meta_model, resolve_model_args
from scaletrain.optim.optimizers import Optimizers, build_optimizer

TARGET_RATIO = 10.0
LAYOUT = make_layout_key(1, "single process")
CHECKS = ("none", "crc32", "sha256")
LOCAL = fsspec.filesystem("file")


class _Position:
    """The data loader's resumable part (the benchmark has no data)."""

    next_sample = 0

    def state_dict(self) -> dict:
        return {"next_sample": self.next_sample}

    def load_state_dict(self, sd: dict) -> None:
        self.next_sample = sd["next_sample"]


def build_state(preset: str, vocab: int) -> tuple[dict, torch.Tensor, int, int]:
    """A model with AdamW after one step (so the moments exist): the state, a parameter that every recovery must
    bring back, the parameter count and the state's bytes."""
    args = resolve_model_args(ModelConfig(preset=preset), vocab, 128)
    model = build_meta_model(args)
    model.to_empty(device="cpu")
    model.init_weights()
    cfg = OptimizerConfig()
    optimizers = Optimizers([model], lambda m: build_optimizer(m, cfg), cfg, 100)
    x = torch.randint(0, args.vocab_size, (1, 129))
    F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    optimizers.step()
    train = TrainState()
    train.step = 1
    state = {
        "model": ModelState([model]),
        "optimizer": optimizers,
        "data": LoaderState(_Position()),
        "train": train,
    }
    n_params = sum(p.numel() for p in model.parameters())
    opt_state = optimizers.optimizers[0].state
    n_bytes = n_params * 4 + sum(v.nbytes for s in opt_state.values() for v in s.values())
    return state, next(model.parameters()), n_params, n_bytes


# -- the checks, as one function per way, over the files of a directory -------------------------------------------
def digests(d: Path, check: str) -> dict[str, object]:
    """Every file's checksum: CRC32 as the memory tier computes it (chunks, torch's threads), sha256 as storage
    checkpoints do (integrity.py: one pass, one thread)."""
    files = sorted(f for f in d.rglob("*") if f.is_file() and f.name != integrity.COMMIT)
    if check == "crc32":
        return {f.name: file_crc32(f) for f in files}
    return {f.name: integrity._sha256(LOCAL, str(f)) for f in files}


def _check_with(want: dict[Path, dict], check: str) -> Callable[[Path], str | None]:
    if check == "none":
        return lambda d: None
    return lambda d: None if digests(Path(d), check) == want[Path(d)] else f"{d} does not match its {check}"


# -- the three places ------------------------------------------------------------------------------------------
class Memory:
    """The in-memory tier as shipped; its CRC32 check is swapped for none or sha256 where asked."""

    def __init__(self, state: dict, root: Path):
        self.state, self.root, self.key = state, root, f"bench-{uuid.uuid4().hex[:8]}"
        self.tier = self._open()
        self.sha: dict[Path, dict] = {}

    def _open(self) -> MemoryTier:
        return MemoryTier(self.key, LAYOUT, root=self.root, max_bytes=1 << 40)

    def save(self, step: int) -> None:
        assert self.tier.snapshot(step, self.state)

    def record(self, step: int) -> None:
        d = self.tier.own / f"step-{step:08d}"
        self.sha = {d: digests(d, "sha256")}

    def recover(self, check: str) -> int:
        swap = (
            nullcontext()
            if check == "crc32"
            else mock.patch.object(memory_tier, "_verify", _check_with(self.sha, check))
        )
        with swap:
            restarted = self._open()  # as a restarted worker does: no check remembered from before
            step = restarted.latest_complete_step()
            restarted.restore(step, self.state)
        return step

    def close(self) -> None:
        self.tier.cleanup()


class DcpShm:
    """What the tier would do on DCP (one rank's own copy: replication is the same bytes either way): dcp.save into
    /dev/shm with the checksums of its files, and to recover: the newest, checked, dcp.load (which reshards)."""

    def __init__(self, state: dict, root: Path):
        self.state, self.root = state, root
        self.want: dict[str, dict[Path, dict]] = {"crc32": {}, "sha256": {}}

    def save(self, step: int) -> None:
        shutil.rmtree(self.root, ignore_errors=True)  # keep one, as the tier does
        d = self.root / f"step-{step:08d}"
        dcp.save(self.state, storage_writer=FileSystemWriter(d), no_dist=True)
        self.want["crc32"] = {d: digests(d, "crc32")}  # part of a DCP tier's snapshot: it is in the timing
        (d / integrity.COMMIT).write_text(str(step))  # the marker, last

    def record(self, step: int) -> None:
        self.want["sha256"] = {d: digests(d, "sha256") for d in self.want["crc32"]}

    def recover(self, check: str) -> int:
        d = max(p.parent for p in self.root.glob(f"step-*/{integrity.COMMIT}"))
        reason = None if check == "none" else _check_with(self.want[check], check)(d)
        assert reason is None, reason
        self.state["train"].saved_ranks = read_metadata(str(d)).state_dict_metadata["train.rng"].size[0]
        dcp.load(self.state, storage_reader=make_reader(str(d)), no_dist=True)
        return int(d.name.split("-")[1])

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class Storage:
    """A storage checkpoint through CheckpointManager as shipped (sha256 in commit.json, checked on load); its check
    is swapped for CRC32 or none where asked. drop_pages() evicts its files from the page cache (the cold runs)."""

    def __init__(self, state: dict, root: Path):
        self.root = root
        self.mgr = CheckpointManager(
            CheckpointConfig(async_save=False, keep_last=1), str(root), state, rank=0, world_size=1
        )
        self.crc: dict[Path, dict] = {}

    def save(self, step: int) -> None:
        self.mgr.save(step, blocking=True)

    def record(self, step: int) -> None:
        d = Path(self.mgr.path(step))
        self.crc = {d: digests(d, "crc32")}
        for f in d.rglob("*"):
            if f.is_file():  # written back now, so that dropping its pages later drops them all
                fd = os.open(f, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)

    def drop_pages(self) -> None:
        for f in self.root.rglob("*"):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)

    def recover(self, check: str) -> int:
        verify = {
            "none": lambda fs, path: None if integrity.read_commit(fs, path) else "no commit",
            "crc32": lambda fs, path: _check_with(self.crc, "crc32")(Path(path)),
        }
        swap = (
            nullcontext() if check == "sha256" else mock.patch.object(manager_module, "verify", verify[check])
        )
        with swap:
            return self.mgr.load_latest()

    def close(self) -> None:
        self.mgr.close(self.mgr.committed_steps()[-1])


# -- measuring -------------------------------------------------------------------------------------------------
def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run_rounds(state: dict, probe: torch.Tensor, places: dict, rounds: int) -> dict[str, list[float]]:
    """Per round: a new snapshot or checkpoint in every place (timed), then every recovery once, order rotated.
    Before each recovery one parameter is moved away, and after it is checked to be back."""
    times: dict[str, list[float]] = {}
    want = probe.detach().clone()
    variants = [(p, c, False) for p in places for c in CHECKS] + [("storage", c, True) for c in CHECKS]
    for r in range(rounds):
        step = r + 1
        state["train"].step = step
        for name, place in places.items():
            times.setdefault(f"save {name}", []).append(_timed(lambda p=place, s=step: p.save(s))[0])
            place.record(step)
        tier_file = places["memory"].tier.own / f"step-{step:08d}" / memory_tier.TENSORS
        for check in ("crc32", "sha256"):
            times.setdefault(f"check alone {check}", []).append(
                _timed(lambda c=check, d=tier_file.parent: digests(d, c))[0]
            )
        shift = r % len(variants)
        for name, check, cold in variants[shift:] + variants[:shift]:
            if cold:
                places[name].drop_pages()
            with torch.no_grad():
                probe.add_(1.0)
            seconds, got = _timed(lambda n=name, c=check: places[n].recover(c))
            assert got == step and torch.equal(probe, want), (name, check, got)
            times.setdefault(f"{name}{' cold' if cold else ''} {check}", []).append(seconds)
    return times


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):7.3f} s  [{min(xs):.3f}-{max(xs):.3f}]"


def report(header: str, times: dict[str, list[float]], n_rounds: int) -> None:
    print(f"\n{header}, {n_rounds} rounds: median [min-max]")
    for key in sorted(times, key=lambda k: (not k.startswith("save"), not k.startswith("check"), k)):
        print(f"  {key:28s} {_spread(times[key])}")
    print("\n  recovery ratios, like for like (the same check on both sides), per round: median [min-max]")
    for place in ("memory", "dcp-shm"):
        for storage in ("storage", "storage cold"):
            for check in CHECKS:
                ratio = [s / m for s, m in zip(times[f"{storage} {check}"], times[f"{place} {check}"])]
                verdict = "meets" if statistics.median(ratio) >= TARGET_RATIO else "misses"
                print(
                    f"  {storage:12s} / {place:7s} {check:6s} {statistics.median(ratio):6.1f}x "
                    f"[{min(ratio):.1f}-{max(ratio):.1f}]  ({verdict} {TARGET_RATIO:.0f}x)"
                )
    shipped = [s / m for s, m in zip(times["storage sha256"], times["memory crc32"])]
    print(
        f"  as shipped (storage sha256 warm / memory crc32): {statistics.median(shipped):.1f}x "
        f"[{min(shipped):.1f}-{max(shipped):.1f}]"
    )


def goodput_drill(steps: int, every: int, config: str, run_dir: Path) -> dict:
    """Train with a worker killed every `every` steps (restarted by the launcher, resumed from the memory tier or
    storage), checkpoints at the Young/Daly `auto` interval; return the job's goodput breakdown."""
    import subprocess
    import sys

    from scaletrain.resilience.goodput import compute_goodput

    kills = [f"kill:rank=0,step={s}" for s in range(every, steps, every)]
    cmd = [
        sys.executable,
        "-m",
        "scaletrain",
        "train",
        "--config",
        config,
        "--run.dir",
        str(run_dir),
        "--training.steps",
        str(steps),
        "--max-restarts",
        str(len(kills) + 1),
        "--checkpoint.interval",
        "auto",
        "--checkpoint.mtbf_hours",
        str(max(every, 1) * 0.5 / 3600),
        "--checkpoint.snapshot_interval",
        "5",
        "--metrics.progress",
        "false",
        "--resilience.inject=[" + ",".join(f'"{k}"' for k in kills) + "]",
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    return compute_goodput(run_dir)


def _drill(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="scaletrain-drill-") as tmp:
        g = goodput_drill(args.drill_steps, args.drill_every, args.drill_config, Path(tmp) / "run")
    print(
        f"goodput drill: {args.drill_steps} steps, a worker killed every {args.drill_every} steps, "
        f"{g['restarts']} restart(s): goodput {g['goodput']:.1%} (target >= 95%)"
    )
    for k in (
        "total_s",
        "productive_s",
        "restart_s",
        "recomputed_s",
        "checkpoint_stall_s",
        "eval_s",
        "other_s",
    ):
        print(f"  {k:20s} {g[k]:8.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="125M")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--drill-steps", type=int, default=0, help="run the goodput drill with this many steps (0: skip)"
    )
    p.add_argument("--drill-every", type=int, default=100, help="kill a worker every N steps in the drill")
    p.add_argument("--drill-config", default="configs/default.toml")
    args = p.parse_args()
    if args.drill_steps:
        _drill(args)
        return
    torch.set_num_threads(args.threads)
    state, probe, n_params, n_bytes = build_state(args.preset, args.vocab)
    disk = Path(tempfile.mkdtemp(prefix="scaletrain-recovery-bench-"))
    shm = default_root() / f"bench-dcp-{uuid.uuid4().hex[:8]}"
    places = {
        "memory": Memory(state, default_root()),
        "dcp-shm": DcpShm(state, shm),
        "storage": Storage(state, disk / "checkpoints"),
    }
    try:
        times = run_rounds(state, probe, places, args.rounds)
    finally:
        for place in places.values():
            place.close()
        shutil.rmtree(disk, ignore_errors=True)
    header = (
        f"{args.preset} preset: {n_params:,} parameters, state {n_bytes / 2**20:,.0f} MiB (weights + AdamW), "
        f"{args.threads} threads, one process"
    )
    report(header, times, args.rounds)


if __name__ == "__main__":
    main()
