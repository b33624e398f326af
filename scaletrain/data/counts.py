"""The token-count index of data.streaming: how many tokens each shard gives under a tokenize job, so that a rank can
move a source's position past a shard it does not read. Counts are shared by the data-parallel ranks over the
control (gloo) group and appended to data.cache_dir/stream-token-counts.jsonl, so a resume on any number of ranks
does not count a shard again.

A count is a fact of the shard's bytes and the job, not of who counted it: two ranks that know different counts walk
to the same position. What must agree across ranks is only *when* they exchange (a collective): that is decided from
`agreed`, the counts every rank of the group holds, never from what one rank knows alone (`pending`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from scaletrain.data.storage import Shard

log = logging.getLogger("scaletrain")

INDEX_NAME = "stream-token-counts.jsonl"

# all_gather of one picklable object a rank over its group: rank order in, rank order out.
Gather = Callable[[object], list]


def shard_key(shard: Shard, digest: str) -> str:
    """A shard's identity for its count: URL, size, its version tag (S3's ETag, a file's mtime) and the digest of
    the tokenize job (data.streaming.job_digest)."""
    return hashlib.sha256(f"{shard.url}\0{shard.size}\0{shard.tag}\0{digest}".encode()).hexdigest()[:32]


def group_gather(group: dist.ProcessGroup) -> tuple[Gather, int]:
    """(all_gather of objects over `group`, this process's rank in it): the control plane's CPU group."""

    def gather(obj: object) -> list:
        out: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    return gather, dist.get_rank(group)


class TokenCounts:
    """Shard key -> token count. `agreed` is the same on every rank of the group (changed only by `share`, which
    every rank calls at the same point); `pending` holds what this rank counted or found on disk since.

    Without a group (one rank, or ranks that cannot talk, as in a test building several loaders in one process)
    every count is agreed at once: each rank then walks by what it counted itself, as before the index."""

    def __init__(self, path: Path | None, gather: Gather | None, group_rank: int = 0):
        self.path, self.gather, self.group_rank = path, gather, group_rank
        self.agreed: dict[str, int] = {}
        self.pending: dict[str, int] = {}
        self.members: list[int] | None = None  # each group rank's data-parallel rank, after the first share
        self.exchanges = 0  # shares so far (benchmarks/streaming.py reports them a step)
        found = self._read()
        (self.pending if gather else self.agreed).update(found)
        self._on_disk = set(found)

    def get(self, key: str) -> int | None:
        return self.agreed.get(key)

    def record(self, key: str, tokens: int) -> None:
        if key in self.agreed:
            return
        if self.gather is None:
            self.agreed[key] = tokens
            if self.group_rank == 0:
                self._write({key: tokens})
        else:
            self.pending[key] = tokens

    def share(self, dp_rank: int) -> None:
        """Exchange what each rank counted (a collective: every rank of the group calls it at the same point)."""
        assert self.gather is not None
        every = self.gather({"dp": dp_rank, "counts": self.pending})
        self.exchanges += 1
        self.pending = {}
        self.members = [int(p["dp"]) for p in every]
        new = {k: v for p in every for k, v in p["counts"].items() if k not in self.agreed}
        self.agreed.update(new)
        if self.group_rank == 0:  # one writer a group (ranks of a node share the file)
            self._write({k: v for k, v in new.items() if k not in self._on_disk})

    def _read(self) -> dict[str, int]:
        """The index on disk; a torn last line (a crash mid-append) is skipped."""
        out: dict[str, int] = {}
        if self.path is None or not self.path.exists():
            return out
        for line in self.path.read_text().splitlines():
            try:
                entry = json.loads(line)
                out[str(entry["key"])] = int(entry["tokens"])
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def _write(self, new: dict[str, int]) -> None:
        if self.path is None or not new:
            return
        lines = "".join(json.dumps({"key": k, "tokens": v}) + "\n" for k, v in new.items())
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # One append a batch of lines (O_APPEND): ranks of other groups writing at once do not interleave.
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, lines.encode())
            finally:
                os.close(fd)
            self._on_disk.update(new)
        except OSError as e:  # the index saves work; a read-only cache only costs a recount on the next start
            log.warning(
                "cannot append to the token-count index %s (%s); shards will be counted again", self.path, e
            )
