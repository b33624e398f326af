"""In-memory checkpoint tier (Gemini, Wang et al. SOSP 2023): a cheap snapshot every few steps kept in node-local
shared memory (/dev/shm, so it outlives a worker restart) and replicated over torch.distributed point-to-point to a
rank on another node (replica_offset): losing one worker, or one whole node with its shared memory, is recovered from
memory instead of storage. Only safetensors and JSON are read back: nothing is ever unpickled.

Layout: <root>/<job_key>/rank<r>/step-NNNNNNNN/{tensors.safetensors, meta.json, COMPLETE} holds rank r's own
snapshot and <root>/<job_key>/replica-of-<r-k>/... the copy of rank r-k's (mod W, k the offset), both in rank r's
slot family. A snapshot counts once its COMPLETE marker exists (written last, by rename); each slot keeps only the
newest. Before a snapshot is restored its bytes are checked against the CRC32s taken when it was written; a copy that
fails is deleted, so the ranks use its replica or else storage (docs/checkpointing.md has the measured cost).
Shared memory is small in containers (Docker's default /dev/shm is 64 MiB): a snapshot that does not fit, or whose
write fails, turns the tier off on every rank alike (SnapshotFailed) and training goes on with storage checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from scaletrain.checkpoint.shm import (
    SHM_ADVICE,
    default_root,
    node_room,
    private_dir,
    remove_stale_jobs,
    restrict_files,
    shortfall,
)

log = logging.getLogger("scaletrain")

TENSORS, META, COMPLETE = "tensors.safetensors", "meta.json", "COMPLETE"
_NAMES = (TENSORS, META, COMPLETE)
_FORMAT = 2  # 2: CRC32s in meta.json and COMPLETE
_SEP = "/"  # joins nested keys; parameter names use "." so never contain it
_CHUNK = 256 << 20  # bytes per point-to-point message
_KEEP_STEPS = 2  # steps per slot published to the group: the newest, and one left by a crash before retention
_CRC_CHUNK = 64 << 20  # bytes per CRC32, so that threads can check the chunks of one file in parallel
# What a full or failing /dev/shm raises: OSError from our own writes (ENOSPC, EFBIG), SafetensorError (not an
# OSError) from safetensors' writer.
WRITE_ERRORS = (OSError, SafetensorError)


class SnapshotFailed(Exception):
    """A snapshot could not be taken: no room in shared memory, or a write failed on some rank. Raised on every rank
    alike (the ranks agree before raising), after which the tier is off (`MemoryTier.off` says why)."""


def job_key(run_dir: str | os.PathLike, run_id: str = "") -> str:
    """A short stable key for a job: a restarted worker of the same run finds the same snapshots. `run_id` (the id
    written into a run directory when it is created) keeps a new run in a deleted-and-recreated directory of the
    same path from restoring the old run's snapshots, which outlive it in shared memory after a crash."""
    return hashlib.sha256(f"{Path(run_dir).resolve()}|{run_id}".encode()).hexdigest()[:16]


def make_layout_key(world_size: int, layout: str) -> str:
    """What a snapshot must match to be restored: the world size and the parallel layout string. A snapshot of
    another layout holds other shards, so it is never used (storage, which reshards, is the fallback)."""
    return f"world={world_size}|{layout}"


def replica_offset(hosts: list[str]) -> int:
    """How far along the ranks each rank's replica goes (rank r's to rank r+k, mod W): the smallest k that puts every
    rank's replica on another node than its own. torchrun numbers a node's ranks contiguously, so with L workers on
    every node that is L (the plain ring, k = 1, would keep L-1 of each node's L replicas at home, and a dead node
    would take both copies). 1 where there is one node, or where no offset separates every pair (nodes of unequal
    sizes); the caller warns then."""
    w = len(hosts)
    for k in range(1, w):
        if all(hosts[(r + k) % w] != hosts[r] for r in range(w)):
            return k
    return 1


# -- flattening: nested dicts -> {"a/b/c": tensor} + {"a/b/d": JSON leaf} -------------------------------------------
def _items(sd: dict, prefix: str) -> Iterator[tuple[str, dict, str, Any]]:
    """Every leaf of a nested dict as (flat key, its container, its key, value); an empty dict is a leaf."""
    for k, v in sd.items():
        if not isinstance(k, str) or _SEP in k:
            raise ValueError(f"state key {prefix}{k!r}: only str keys without {_SEP!r} can be snapshotted")
        flat = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            yield from _items(v, flat + _SEP)
        else:
            yield flat, sd, k, v


def _encode(v: Any, key: str) -> Any:
    """A JSON value for a non-tensor leaf; tuples are tagged so they come back as tuples (AdamW's betas)."""
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, tuple):
        return {"__tuple__": [_encode(x, key) for x in v]}
    if isinstance(v, list):
        return [_encode(x, key) for x in v]
    if isinstance(v, dict):
        return {"__dict__": {str(k): _encode(x, key) for k, x in v.items()}}
    raise ValueError(
        f"state leaf {key!r} of type {type(v).__name__} cannot be snapshotted (tensors, dicts and "
        "JSON scalars only)"
    )


def _decode(v: Any) -> Any:
    if isinstance(v, list):
        return [_decode(x) for x in v]
    if isinstance(v, dict):
        if "__tuple__" in v:
            return tuple(_decode(x) for x in v["__tuple__"])
        return {k: _decode(x) for k, x in v["__dict__"].items()}
    return v


def flatten_state(sd: dict) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a nested state dict into flat tensors (DTensors as their local shard) and JSON-encoded other leaves."""
    tensors, leaves = {}, {}
    for flat, _, _, v in _items(sd, ""):
        if isinstance(v, torch.Tensor):
            tensors[flat] = v.to_local() if isinstance(v, DTensor) else v
        else:
            leaves[flat] = _encode(v, flat)
    return tensors, leaves


def unflatten_state(tensors: dict[str, torch.Tensor], leaves: dict[str, Any]) -> dict:
    """The inverse of flatten_state (DTensors come back as plain local tensors)."""
    out: dict = {}
    items = [*tensors.items(), *((k, _decode(v)) for k, v in leaves.items())]
    for flat, v in items:
        *path, last = flat.split(_SEP)
        node = out
        for p in path:
            node = node.setdefault(p, {})
        node[last] = v
    return out


def _entry_bytes(key: str, t: torch.Tensor) -> int:
    """What one tensor adds to a safetensors file: its bytes and a JSON header entry (~100 bytes)."""
    return t.numel() * t.element_size() + 128 + len(key)


def snapshot_bytes(state: dict) -> int:
    """The size of this rank's snapshot of `state`, counted without copying anything."""
    total = 0
    for name, obj in state.items():
        sd = obj.state_dict() if hasattr(obj, "state_dict") else obj
        tensors, _ = flatten_state({name: sd})
        total += sum(_entry_bytes(k, t) for k, t in tensors.items())
    return total


def _savable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors wants contiguous CPU tensors that do not overlap in memory; tied weights (the embedding and the
    output share one) overlap, so the repeats are cloned."""
    out, spans = {}, {}
    for k, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        if t.numel():
            key = t.untyped_storage().data_ptr()
            lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
            if any(a < hi and lo < b for a, b in spans.get(key, ())):
                t = t.clone()
            else:
                spans.setdefault(key, []).append((lo, hi))
        out[k] = t
    return out


def _fill(
    target: dict, prefix: str, tensors: dict[str, torch.Tensor], leaves: dict[str, Any], errors: list[str]
) -> None:
    """Copy snapshot values into a Stateful's own state_dict (in place; DTensors into their local shard)."""
    for flat, container, k, v in _items(target, prefix):
        if isinstance(v, torch.Tensor):
            src = tensors.pop(flat, None)
            dst = v.to_local() if isinstance(v, DTensor) else v
            if src is None:
                errors.append(f"{flat}: not in the snapshot")
            elif src.shape != dst.shape or src.dtype != dst.dtype:
                errors.append(
                    f"{flat}: snapshot {src.dtype}{list(src.shape)}, state {dst.dtype}{list(dst.shape)}"
                )
            else:
                dst.copy_(src)
        elif flat in leaves:
            container[k] = _decode(leaves.pop(flat))
        else:
            errors.append(f"{flat}: not in the snapshot")


# -- files -------------------------------------------------------------------------------------------------------
def _step_dir(slot: Path, step: int) -> Path:
    return slot / f"step-{step:08d}"


def _write_marker(path: Path, info: dict) -> None:
    tmp = path.with_name(COMPLETE + ".tmp")
    tmp.write_text(json.dumps(info))
    restrict_files(path.parent)  # within a 0700 root already; 0600 too, should the root ever be opened
    os.replace(tmp, path)  # atomic: a snapshot either has its marker or does not exist


def _read_meta(d: Path) -> dict | None:
    """The metadata of a complete, intact snapshot directory, else None."""
    try:
        if not (d / COMPLETE).is_file():
            return None
        meta = json.loads((d / META).read_text())
        if meta.get("format") != _FORMAT or (d / TENSORS).stat().st_size != meta["bytes"]:
            return None
        return meta
    except (OSError, ValueError, KeyError):
        return None


def _dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) if d.is_dir() else 0


def file_crc32(path: Path, chunk: int = _CRC_CHUNK) -> list[int]:
    """The CRC32 of each `chunk` bytes of a file, read from its mapping, on torch's thread count (zlib releases the
    GIL). Not the sha256 of storage checkpoints: the check is against damage (a stray write, a flipped bit), which a
    CRC catches as well, in 0.37 s against 1.30 s for the 1.4 GiB of benchmarks/recovery.py (2 threads against 1);
    a digest kept next to the data stops no one who can write to it either way."""
    n = path.stat().st_size
    if n == 0:
        return []
    chunks = [c.numpy() for c in _map_file(path, n).split(chunk)]
    with ThreadPoolExecutor(max(1, min(torch.get_num_threads(), len(chunks)))) as pool:
        return list(pool.map(zlib.crc32, chunks))


def _verify(d: Path) -> str | None:
    """None when the snapshot in `d` still holds the bytes it was written with, else what differs."""
    try:
        meta_b = (d / META).read_bytes()
        if zlib.crc32(meta_b) != json.loads((d / COMPLETE).read_text())["meta_crc32"]:
            return f"{META} does not match its checksum"
        meta = json.loads(meta_b)
        got, want = file_crc32(d / TENSORS, meta["crc32_chunk"]), meta["crc32"]
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        return f"unreadable ({e})"
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    if bad or len(got) != len(want):
        where = f", first at byte {bad[0] * meta['crc32_chunk']}" if bad else ""
        return f"{TENSORS} does not match its checksums ({len(bad)} of {len(want)} chunks differ{where})"
    return None


def _signature(d: Path) -> tuple | None:
    """What changes when a snapshot's files are replaced or written to: a check is valid until it changes."""
    try:
        stats = [os.stat(d / f) for f in _NAMES]
        return tuple((s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns) for s in stats)
    except OSError:
        return None


class MemoryTier:
    """One rank's view of the tier. Every method but bytes_used() is collective over `group` (a dedicated gloo
    group; None for one process), so all ranks call them in the same order with the same step."""

    def __init__(
        self,
        job_key: str,
        layout_key: str,
        *,
        group: dist.ProcessGroup | None = None,
        max_bytes: int = 2048 << 20,
        root: str | os.PathLike | None = None,
        ttl_s: float = 0.0,
        hosts: list[str] | None = None,
    ):
        """`hosts`: each rank's node (the start event's node table); None: each rank's hostname, gathered here."""
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.layout_key = layout_key
        self.max_bytes = max_bytes
        self.job_dir = private_dir(Path(root) if root is not None else default_root()) / job_key
        self.own = self.job_dir / f"rank{self.rank}"
        self.hosts = hosts if hosts is not None else self._gather_hosts()
        self.offset = replica_offset(self.hosts)
        self.prev = (self.rank - self.offset) % self.world_size  # whose replica this rank holds
        self.next = (self.rank + self.offset) % self.world_size  # who holds this rank's replica
        w, home = self.world_size, self.hosts
        shared = [r for r in range(w) if home[(r + self.offset) % w] == home[r]] if len(set(home)) > 1 else []
        if self.rank == 0 and shared:
            log.warning("memory tier: nodes of unequal sizes (%s): the replicas of ranks %s share their owner's "
                        "node, whose loss then sends the job to storage", home, shared)  # fmt: skip
        self.replica = self.job_dir / f"replica-of-{self.prev}" if self.world_size > 1 else None
        self.last_snapshot_s = 0.0
        self.last_restore_s = 0.0
        self.restored_from_peer = False
        # The last restore's ranks that took their replica: {rank: the rank holding it}.
        self.restored_from: dict[int, int] = {}
        self.closed = False
        self.off: str | None = None  # why the tier turned itself off (no room, a failed write); None: on
        self._checked: dict[
            Path, tuple
        ] = {}  # snapshot dir -> its files' signature when its checksums passed
        self._find_s = 0.0  # the last latest_complete_step()'s time (checksums included), part of a restore's
        if ttl_s > 0:
            remove_stale_jobs(self.job_dir.parent, ttl_s, keep=self.job_dir.name)
        self._adopt_slots()

    def _adopt_slots(self) -> None:
        """After a re-formed job numbered the nodes otherwise (the rendezvous orders them by hostname, so a
        replacement node can take the survivor's ranks), this node may hold this rank's snapshot as a replica, and
        the replica it should hold as the own slot of a rank that now lives elsewhere: rename them into place. Each
        rank moves only slots that no rank of this node claims, so no two ranks move the same one."""
        if self.world_size == 1:
            return
        here = self.hosts[self.rank]
        moves = []
        if self.hosts[self.next] != here:  # replica-of-<rank> is nobody's here: my own copy, when it exists
            moves.append((self.job_dir / f"replica-of-{self.rank}", self.own))
        if self.hosts[self.prev] != here:  # rank<prev> is nobody's here: the replica I hold, when it exists
            moves.append((self.job_dir / f"rank{self.prev}", self.replica))
        for src, dst in moves:
            if src.is_dir() and not dst.exists():
                os.replace(src, dst)
                log.info("memory tier: rank %d took over %s as %s", self.rank, src.name, dst.name)

    # -- snapshot ----------------------------------------------------------------------------------------------
    def snapshot(self, step: int, state: dict) -> bool:
        """Snapshot every Stateful of `state` at `step` into this rank's slot and its replica on another node;
        keep only the newest complete one per slot. Returns False (on every rank) when some rank's own copy plus
        the replica it holds would exceed max_bytes: that snapshot is skipped with a warning. Raises SnapshotFailed
        (on every rank) when it does not fit in some node's free shared memory or a write fails: the new step's
        files are removed, the previous snapshot stays, and the tier is off."""
        assert not self.closed, "memory tier used after close()"
        assert self.off is None, "memory tier used after it turned off"
        t0 = time.perf_counter()
        self._find_s = 0.0
        tensors, leaves = {}, {}
        for name, obj in state.items():
            sd = obj.state_dict() if hasattr(obj, "state_dict") else obj
            t, lv = flatten_state({name: sd})
            tensors.update(t)
            leaves.update(lv)
        tensors = _savable(tensors)
        meta = {
            "format": _FORMAT,
            "step": step,
            "rank": self.rank,
            "world_size": self.world_size,
            "layout_key": self.layout_key,
            "leaves": leaves,
        }
        table = self._space_table(sum(_entry_bytes(k, t) for k, t in tensors.items()))
        held = self._held(table[:, 0].tolist())
        over = [r for r, n in enumerate(held) if n > self.max_bytes]
        if over:  # every rank sees every size, so all skip together
            log.warning(
                "memory tier: snapshot at step %d skipped: rank %d would hold %.0f MiB (own + replica), "
                "over the bound of %.0f MiB (checkpoint.snapshot_max_mb)",
                step,
                over[0],
                held[over[0]] / 2**20,
                self.max_bytes / 2**20,
            )
            return False
        # Written beside the snapshot kept now (removed only once the new one is complete everywhere).
        short = self._shortfall(table, copies=1)
        if short is not None:
            self._turn_off(f"no room for the snapshot of step {step}: {short}")

        d = _step_dir(self.own, step)
        error = None
        try:
            shutil.rmtree(d, ignore_errors=True)  # a half-written one from before a crash
            d.mkdir(parents=True, mode=0o700)
            save_file(tensors, d / TENSORS)
            # The checksums are of the file as written (read back from shared memory), not of the tensors.
            meta.update(
                bytes=(d / TENSORS).stat().st_size,
                crc32=file_crc32(d / TENSORS, _CRC_CHUNK),
                crc32_chunk=_CRC_CHUNK,
            )
            meta_b = json.dumps(meta).encode()
            (d / META).write_bytes(meta_b)
            _write_marker(
                d / COMPLETE, {"step": step, "bytes": meta["bytes"], "meta_crc32": zlib.crc32(meta_b)}
            )
        except WRITE_ERRORS as e:
            error = e
        del tensors
        # Every rank learns of a failed write before the next collective: a rank that went on to replicate would
        # wait for a peer that never sends.
        self._agree(step, error, "writing the snapshot")
        if self.world_size > 1:
            # Its last agreement is the barrier before retention: the old snapshots stay until every rank holds the
            # new one and its replica, so a failure at any moment leaves one complete generation.
            self._replicate(step, d)
        for slot in (self.own, self.replica):
            self._retain(slot, step)
        self.last_snapshot_s = time.perf_counter() - t0
        return True

    def _replicate(self, step: int, d: Path) -> None:
        """Send my snapshot to rank r+k on another node, receive rank r-k's into my replica slot. Sizes (and the checksum of
        the metadata, which holds the others) first, then bytes: the replica is checked as the original is."""
        meta_b = (d / META).read_bytes()
        n = (d / TENSORS).stat().st_size
        header = torch.tensor([step, len(meta_b), n, zlib.crc32(meta_b)], dtype=torch.int64)
        theirs = torch.empty(4, dtype=torch.int64)
        exchange([(header, self.next)], [(theirs, self.prev)], self.group)
        their_step, their_meta, their_n, their_crc = theirs.tolist()
        rd = _step_dir(self.replica, their_step)
        meta_in = torch.empty(their_meta, dtype=torch.uint8)
        error, out_file = None, None
        try:
            shutil.rmtree(rd, ignore_errors=True)
            rd.mkdir(parents=True, mode=0o700)
            out_file = _map_file(rd / TENSORS, their_n, create=True)
        except WRITE_ERRORS as e:
            error = e
        self._agree(step, error, "allocating the replica")
        exchange(
            [
                (torch.frombuffer(bytearray(meta_b), dtype=torch.uint8), self.next),
                (_map_file(d / TENSORS, n), self.next),
            ],
            [(meta_in, self.prev), (out_file, self.prev)],
            self.group,
        )
        del out_file
        error = None
        try:
            (rd / META).write_bytes(meta_in.numpy().tobytes())
            _write_marker(rd / COMPLETE, {"step": their_step, "bytes": their_n, "meta_crc32": their_crc})
        except WRITE_ERRORS as e:
            error = e
        self._agree(step, error, "writing the replica")

    # -- room in shared memory, failures -----------------------------------------------------------------------
    def check_room(self, estimate: int) -> tuple[str | None, str | None]:
        """Whether snapshots of `estimate` bytes on this rank (every rank passes its own) fit in the free shared
        memory of every node: (why not even one fits, why the next does not fit beside the one kept), each None
        when it does. When not even one fits the tier turns off. Collective; every rank gets the same answer."""
        table = self._space_table(estimate)
        short = self._shortfall(table, copies=1)
        if short is not None:
            self.off = f"no room for a snapshot: {short}; {SHM_ADVICE}"
        return self.off, self._shortfall(table, copies=2)

    def _space_table(self, estimate: int) -> torch.Tensor:
        """Per rank (one all-gather): its snapshot's size, its node's shared memory, the free bytes there, and what
        this job holds there now."""
        return self._all_gather([estimate, *node_room(self.job_dir.parent), _dir_bytes(self.job_dir)])

    def _held(self, sizes: list[int]) -> list[int]:
        """What each rank keeps per snapshot: its own copy and the replica it holds."""
        w = self.world_size
        return [sizes[r] + (sizes[(r - self.offset) % w] if w > 1 else 0) for r in range(w)]

    def _shortfall(self, table: torch.Tensor, copies: int) -> str | None:
        rows = table.tolist()
        return shortfall(rows, self._held([row[0] for row in rows]), copies, self.job_dir.parent)

    def _agree(self, step: int, error: BaseException | None, what: str) -> None:
        """After a write every rank did: go on together, or (when it failed on some rank) remove this step's files
        and raise SnapshotFailed on every rank, with the first failed rank's error."""
        failed = self._all_gather([int(error is not None)])[:, 0].tolist()
        if not any(failed):
            return
        mine = f"{type(error).__name__}: {str(error).strip()}" if error is not None else ""
        errors = [mine]
        if self.world_size > 1:
            errors = [""] * self.world_size
            dist.all_gather_object(errors, mine, group=self.group)
        first = failed.index(1)
        shutil.rmtree(_step_dir(self.own, step), ignore_errors=True)
        if self.replica is not None:
            shutil.rmtree(_step_dir(self.replica, step), ignore_errors=True)
        if self.world_size > 1:
            # Once any rank is past this point no rank's files of the step remain (a rank that lists the tier, or
            # a restart that reads it, never finds a peer's half-written snapshot).
            dist.barrier(group=self.group)
        self._turn_off(f"{what} of step {step} failed on rank {first}: {errors[first]}")

    def _turn_off(self, reason: str) -> None:
        self.off = f"{reason}; {SHM_ADVICE}"
        raise SnapshotFailed(self.off)

    def _retain(self, slot: Path | None, keep: int) -> None:
        if slot is None or not slot.is_dir():
            return
        for d in slot.iterdir():
            if d.name != f"step-{keep:08d}":
                shutil.rmtree(d, ignore_errors=True)

    # -- choosing and restoring -------------------------------------------------------------------------------
    def _steps(self, slot: Path | None, owner: int, layout_key: str) -> list[int]:
        """Complete snapshots of `owner` in `slot` taken in this layout, newest first."""
        if slot is None or not slot.is_dir():
            return []
        found = []
        for d in slot.iterdir():
            meta = _read_meta(d) if d.name.startswith("step-") else None
            if (
                meta is not None
                and meta["layout_key"] == layout_key
                and meta["rank"] == owner
                and meta["world_size"] == self.world_size
            ):
                found.append(meta["step"])
        return sorted(found, reverse=True)[:_KEEP_STEPS]

    def other_layout_step(self) -> tuple[int, str] | None:
        """The newest snapshot in this node's slots taken in another world size or layout, (step, its layout key),
        None when there is none: the tier restores only into the layout it was taken in, so a job re-formed on fewer
        nodes (`--nnodes MIN:MAX`) cannot use it, and says so rather than start over without a word. Local only."""
        found = []
        for d in self.job_dir.glob("*/step-*") if self.job_dir.is_dir() else []:
            meta = _read_meta(d)
            if meta is not None and (meta["layout_key"], meta["world_size"]) != (
                self.layout_key,
                self.world_size,
            ):
                found.append((meta["step"], meta["layout_key"]))
        return max(found, default=None)

    def latest_complete_step(self, layout_key: str | None = None) -> int | None:
        """The newest step every rank can restore intact, from its own slot or else from the replica another node
        holds; None when there is none in this layout (the caller then loads from storage). The copies it counts on
        are checked against their checksums here, so a damaged one sends the ranks to its replica or to storage."""
        assert not self.closed, "memory tier used after close()"
        t0 = time.perf_counter()
        key = self.layout_key if layout_key is None else layout_key
        own = self._steps(self.own, self.rank, key)
        held = self._steps(self.replica, self.prev, key) if self.world_size > 1 else []
        table = self._all_gather(
            [*own, *[-1] * (_KEEP_STEPS - len(own)), *held, *[-1] * (_KEEP_STEPS - len(held))]
        )
        avail = []
        for r in range(self.world_size):
            mine = set(table[r, :_KEEP_STEPS].tolist())
            if self.world_size > 1:
                mine |= set(table[(r + self.offset) % self.world_size, _KEEP_STEPS:].tolist())
            avail.append(mine - {-1})
        # Every rank walks the same candidates (from the gathered table), so the collectives inside line up.
        found = None
        for step in sorted(set.intersection(*avail), reverse=True):
            if self._intact_everywhere(step, step in own, step in held):
                found = step
                break
        self._find_s = time.perf_counter() - t0
        return found

    def _intact_everywhere(self, step: int, have_own: bool, have_held: bool) -> bool:
        """Whether every rank has an intact copy of `step`: each checks its own, and only for a rank whose own copy
        failed does the rank holding its replica check it (a replica costs a checksum pass only when needed)."""
        ok = have_own and self._intact(_step_dir(self.own, step))
        oks = self._all_gather([int(ok)])[:, 0].tolist()
        if all(oks) or self.world_size == 1:
            return all(oks)
        held_ok = not oks[self.prev] and have_held and self._intact(_step_dir(self.replica, step))
        helds = self._all_gather([int(held_ok)])[:, 0].tolist()
        return all(oks[r] or helds[(r + self.offset) % self.world_size] for r in range(self.world_size))

    def _intact(self, d: Path) -> bool:
        """Whether the snapshot in `d` passes its checksums. One that fails is deleted, which turns a damaged copy
        into a lost one, the case the replica and storage already cover. A pass holds until the files change."""
        sig = _signature(d)
        if sig is not None and self._checked.get(d) == sig:
            return True
        reason = _verify(d)
        if reason is None:
            self._checked[d] = sig
            return True
        log.warning("memory tier: rank %d: snapshot %s rejected and removed: %s", self.rank, d, reason)
        self._checked.pop(d, None)
        shutil.rmtree(d, ignore_errors=True)
        return False

    def restore(self, step: int, state: dict) -> None:
        """Fill `state` in place from the snapshot at `step` (one latest_complete_step agreed on). A rank whose own
        copy is gone or damaged (a lost node, a stray write) gets it back from the rank holding its replica, which
        also heals its slot; nothing is loaded that has not passed its checksums."""
        assert not self.closed, "memory tier used after close()"
        t0 = time.perf_counter()
        d = _step_dir(self.own, step)
        meta = self._own_intact_meta(d)
        need = self._all_gather([int(meta is None)])[:, 0].tolist()
        if any(need):
            self._fetch_from_peer(step, need)
            meta = self._own_intact_meta(d)
            missing = [r for r, m in enumerate(self._all_gather([int(meta is None)])[:, 0].tolist()) if m]
            if missing:  # raised on every rank alike, so none is left waiting in a collective
                raise FileNotFoundError(f"memory tier: no intact copy of step {step} for ranks {missing}")
        self.restored_from_peer = bool(need[self.rank])
        self.restored_from = {r: (r + self.offset) % self.world_size for r, n in enumerate(need) if n}
        tensors = load_file(d / TENSORS)
        leaves = dict(meta["leaves"])
        errors: list[str] = []
        for name, obj in state.items():
            stateful = hasattr(obj, "state_dict")
            target = obj.state_dict() if stateful else obj
            _fill({name: target}, "", tensors, leaves, errors)
            if stateful and not errors:
                obj.load_state_dict(target)
        errors += [f"{k}: in the snapshot, not in the state" for k in [*tensors, *leaves]]
        if errors:
            raise ValueError(
                f"memory tier: snapshot of step {step} does not fit the state ({len(errors)} "
                f"problems), e.g. {'; '.join(errors[:3])}"
            )
        # What the caller waited for: choosing the step (and checking its checksums there) and filling the state.
        self.last_restore_s = self._find_s + time.perf_counter() - t0
        self._find_s = 0.0

    def _own_intact_meta(self, d: Path) -> dict | None:
        """The metadata of this rank's snapshot in `d` when it is of this layout and passes its checksums."""
        meta = _read_meta(d)
        mine = (self.layout_key, self.rank, self.world_size)
        ok = meta is not None and (meta["layout_key"], meta["rank"], meta["world_size"]) == mine
        return meta if ok and self._intact(d) else None

    def _fetch_from_peer(self, step: int, need: list[int]) -> None:
        """Ranks r with need[r] receive their snapshot of `step` from the replica slot of the rank holding it:
        a header (found, meta bytes, tensor bytes, meta checksum) first, then the bytes. Only a replica that passes
        its checksums is sent; the receiver checks its copy again before loading it."""
        if self.world_size == 1:
            return
        d, rd = _step_dir(self.own, step), _step_dir(self.replica, step)
        give = need[self.prev]  # the rank whose replica I hold needs it back
        take = need[self.rank]
        meta = _read_meta(rd) if give else None
        meta = meta if meta is not None and self._intact(rd) else None
        meta_b = (rd / META).read_bytes() if meta is not None else b""
        header_out = torch.tensor(
            [int(meta is not None), len(meta_b), meta["bytes"] if meta else 0, zlib.crc32(meta_b)]
        )
        header_in = torch.zeros(4, dtype=torch.int64)
        exchange(
            [(header_out, self.prev)] if give else [], [(header_in, self.next)] if take else [], self.group
        )
        found, n_meta, n, meta_crc = header_in.tolist()
        sends, recvs = [], []
        if meta is not None:
            sends = [
                (torch.frombuffer(bytearray(meta_b), dtype=torch.uint8), self.prev),
                (_map_file(rd / TENSORS, meta["bytes"]), self.prev),
            ]
        if found:
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True, mode=0o700)
            recvs = [
                (torch.empty(n_meta, dtype=torch.uint8), self.next),
                (_map_file(d / TENSORS, n, create=True), self.next),
            ]
        exchange(sends, recvs, self.group)
        if found:
            (d / META).write_bytes(recvs[0][0].numpy().tobytes())
            del recvs
            _write_marker(d / COMPLETE, {"step": step, "bytes": n, "meta_crc32": meta_crc})
            log.warning("memory tier: rank %d restored its snapshot of step %d from the replica of rank %d on %s",
                        self.rank, step, self.next, self.hosts[self.next])  # fmt: skip

    # -- bookkeeping -------------------------------------------------------------------------------------------
    def bytes_used(self) -> int:
        """Bytes this rank holds in shared memory: its own snapshots plus the replica it keeps (not collective)."""
        return _dir_bytes(self.own) + (_dir_bytes(self.replica) if self.replica is not None else 0)

    def close(self) -> None:
        """End this rank's use of the tier. The snapshots stay in shared memory (a restarted worker finds them;
        cleanup() removes them) and the group stays the caller's to destroy."""
        self.closed = True

    def cleanup(self) -> None:
        """Remove the job's directory (at the successful end of a job): snapshots, replicas and any slots left by
        an earlier world size. Collective, so no rank deletes while another still writes."""
        if self.group is not None and self.world_size > 1:
            dist.barrier(group=self.group)
        shutil.rmtree(self.job_dir, ignore_errors=True)
        self.closed = True

    # -- communication -----------------------------------------------------------------------------------------
    def _gather_hosts(self) -> list[str]:
        hosts = [socket.gethostname()]
        if self.group is not None and self.world_size > 1:
            hosts = [""] * self.world_size
            dist.all_gather_object(hosts, socket.gethostname(), group=self.group)
        return hosts

    def _all_gather(self, values: list[int]) -> torch.Tensor:
        mine = torch.tensor(values, dtype=torch.int64)
        if self.group is None or self.world_size == 1:
            return mine.unsqueeze(0)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rows, mine, group=self.group)
        return torch.stack(rows)


def exchange(
    sends: list[tuple[torch.Tensor, int]],
    recvs: list[tuple[torch.Tensor, int]],
    group: dist.ProcessGroup | None,
) -> None:
    """Point-to-point sends and receives (group ranks), posted together so a ring cannot deadlock, in chunks so that
    no single message nears 2 GiB (where transports' 32-bit sizes start to bite); returns once every byte is where
    it was sent, or raises the transport's error when a peer is gone.

    Each sender ends its data with a marker and each receiver, once a sender's marker is in, acknowledges it; the
    ranks wait on markers and acknowledgements first. Why: gloo tells a broken connection to the operations still
    queued on it, not to the receive whose bytes are arriving nor to a send being written (gloo's
    transport/tcp/pair.cc, signalException), so a rank that waited on its data when the peer's node died waited
    out the group's timeout (10 minutes) with no error: both ranks of the surviving node did, in a node-loss drill
    killed during replication. A marker or an acknowledgement is queued, not in flight, until every byte before it
    arrived, so waiting on it raises "Connection closed by peer [address]" at once, which names the lost node."""
    chunks = lambda t: [c for c in t.split(_CHUNK) if c.numel()]  # noqa: E731
    takes_from = sorted({r for _, r in recvs})
    gives_to = sorted({r for _, r in sends})
    data = [dist.isend(c, group_dst=r, group=group) for t, r in sends for c in chunks(t)]
    # The marker, after the data (a pair delivers in the order sent).
    data += [dist.isend(torch.zeros(1), group_dst=r, group=group) for r in gives_to]
    data += [dist.irecv(c, group_src=r, group=group) for t, r in recvs for c in chunks(t)]
    markers = [dist.irecv(torch.empty(1), group_src=r, group=group) for r in takes_from]
    acks = [dist.irecv(torch.empty(1), group_src=r, group=group) for r in gives_to]
    for w in markers:  # every byte from that sender is in
        w.wait()
    data += [dist.isend(torch.zeros(1), group_dst=r, group=group) for r in takes_from]
    for w in acks:  # every byte to that receiver is in
        w.wait()
    for w in data:  # done or all but done by now
        w.wait()


def _map_file(path: Path, n: int, *, create: bool = False) -> torch.Tensor:
    """The file as a uint8 tensor mapped from shared memory: bytes are sent from and received into /dev/shm with
    no extra copy."""
    if create:
        # Allocated now, so that a full tmpfs fails here with ENOSPC, not with SIGBUS when the mapping is written.
        with open(path, "wb") as f:
            if n:
                os.posix_fallocate(f.fileno(), 0, n)
    return torch.from_file(str(path), shared=True, size=n, dtype=torch.uint8)
