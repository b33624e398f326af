"""Sharded checkpoints through DCP, saved in two stages (MegaScale, Jiang et al. 2024): stage 1 copies the state
to host memory and training resumes; stage 2 writes to storage in the background. At most one save is in flight.
A checkpoint counts once every rank finished and rank 0 wrote the commit marker; loading takes the newest intact
one and reshards it into whatever layout is running now.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from concurrent.futures import Future

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from scaletrain.checkpoint.integrity import read_commit, verify, write_commit
from scaletrain.checkpoint.safe_load import make_reader, read_metadata
from scaletrain.config import CheckpointConfig

log = logging.getLogger("scaletrain")
_STEP_DIR = re.compile(r"step-(\d{8})$")


class CheckpointManager:
    def __init__(
        self,
        cfg: CheckpointConfig,
        root: str,
        state: dict,
        *,
        rank: int,
        world_size: int,
        event: Callable[..., None] = lambda *a, **k: None,
        on_commit: Callable[[int, str], None] = lambda step, path: None,
    ):
        self.cfg = cfg
        self.root = root.rstrip("/")
        self.fs, _ = fsspec.core.url_to_fs(self.root)
        self.state = state
        self.rank = rank
        self.event = event
        self.on_commit = on_commit
        self.stalls: dict[int, float] = {}  # step -> seconds the save blocked training
        # Background saves talk over their own gloo group, never interleaving with the training collectives.
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None
        # poll() agrees on "every rank finished writing" while the upload thread still uses self.group: a group
        # of its own, since collectives of two threads must never interleave on one group.
        self.poll_group = dist.new_group(backend="gloo") if world_size > 1 else None
        self.pending: tuple[int, Future] | None = None
        self.staging: Future | None = None
        self.stager = None
        self.last_stall_s = 0.0

    # -- saving ------------------------------------------------------------------------------------------------
    def path(self, step: int) -> str:
        return f"{self.root}/step-{step:08d}"

    def save(self, step: int, *, blocking: bool = False) -> float:
        """Save the state at `step`; return how long training was blocked (seconds)."""
        t0 = time.perf_counter()
        self.wait()
        path = self.path(step)
        if self.rank == 0:
            self.fs.makedirs(path, exist_ok=True)
        self._barrier()
        writer = FsspecWriter(path) if "://" in path else FileSystemWriter(path)
        no_dist = self.group is None
        if self.cfg.async_save and not blocking:
            # Stage 1 (the copy to host memory) runs in a thread beside the next forward/backward, which does not
            # change the weights; before_update() waits for it before the optimizer does.
            if self.stager is None:
                cuda = torch.cuda.is_available()
                self.stager = DefaultStager(
                    StagingOptions(
                        use_pinned_memory=cuda,
                        use_shared_memory=False,
                        use_async_staging=True,
                        use_non_blocking_copy=cuda,
                    )
                )
            resp = dcp.async_save(
                self.state,
                storage_writer=writer,
                process_group=self.group,
                no_dist=no_dist,
                async_stager=self.stager,
            )
            self.staging = getattr(resp, "staging_completion", None)
            self.pending = (step, getattr(resp, "upload_completion", resp))
        else:
            dcp.save(self.state, storage_writer=writer, process_group=self.group, no_dist=no_dist)
            self._commit(step)
        self.last_stall_s = time.perf_counter() - t0
        self.stalls[step] = self.stalls.get(step, 0.0) + self.last_stall_s
        return self.last_stall_s

    def before_update(self) -> float:
        """Block until stage 1 of the save in flight has copied the state (call before the optimizer changes it);
        return the seconds waited."""
        if self.staging is None:
            return 0.0
        t0 = time.perf_counter()
        self.staging.result()
        self.staging = None
        waited = time.perf_counter() - t0
        self.last_stall_s += waited
        if self.pending is not None:
            self.stalls[self.pending[0]] = self.stalls.get(self.pending[0], 0.0) + waited
        return waited

    def poll(self) -> None:
        """Commit the save in flight as soon as every rank has finished writing it (cheap when none is pending),
        so a checkpoint counts as early as possible rather than at the next save."""
        if self.pending is None:
            return
        done = torch.tensor([1.0 if self.pending[1].done() else 0.0])
        if self.poll_group is not None:
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.poll_group)
        if done.item() == 1.0:
            self.wait()

    def wait(self) -> None:
        """Finish the save in flight (if any) and commit it."""
        self.before_update()
        if self.pending is None:
            return
        step, fut = self.pending
        self.pending = None
        fut.result()
        self._barrier()
        self._commit(step)

    def _commit(self, step: int) -> None:
        if self.rank == 0:
            write_commit(self.fs, self.path(step), {"step": step})
            self.event(
                "checkpoint_saved", step=step, path=self.path(step), blocking_s=self.stalls.pop(step, 0.0)
            )
            self._retain()
            self.on_commit(step, self.path(step))
        self._barrier()

    def _retain(self) -> None:
        """Keep the newest keep_last committed checkpoints plus every keep_every-th; drop older partial saves."""
        steps = self.committed_steps()
        keep = set(steps[-self.cfg.keep_last :]) if self.cfg.keep_last > 0 else set(steps)
        if self.cfg.keep_every > 0:
            keep |= {s for s in steps if s % self.cfg.keep_every == 0}
        newest = steps[-1] if steps else -1
        for s in self._all_steps():
            if s not in keep and s < newest:
                self.fs.rm(self.path(s), recursive=True)

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    # -- loading -----------------------------------------------------------------------------------------------
    def _all_steps(self) -> list[int]:
        if not self.fs.exists(self.root):
            return []
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        return sorted(int(m.group(1)) for n in names if (m := _STEP_DIR.match(n)))

    def committed_steps(self) -> list[int]:
        return [s for s in self._all_steps() if read_commit(self.fs, self.path(s)) is not None]

    def load_latest(self) -> int | None:
        """Load the newest intact checkpoint into the state; return its step, or None when there is none.
        A corrupted or half-written one is logged and skipped in favour of the one before it."""
        choice = None
        if self.rank == 0:
            for step in reversed(self._all_steps()):
                reason = verify(self.fs, self.path(step))
                if reason is None:
                    choice = step
                    break
                log.warning("checkpoint %s skipped: %s", self.path(step), reason)
                self.event("checkpoint_rejected", step=step, path=self.path(step), reason=reason)
        choice = self._broadcast(choice)
        if choice is None:
            return None
        path = self.path(choice)
        train_state = self.state.get("train")
        if train_state is not None:
            rows = read_metadata(path).state_dict_metadata["train.rng"].size[0]
            train_state.saved_ranks = rows
        dcp.load(
            self.state, storage_reader=make_reader(path), process_group=self.group, no_dist=self.group is None
        )
        if self.rank == 0:
            self.event("checkpoint_loaded", step=choice, path=path)
        log.info("resumed from %s", path)
        return choice

    def _broadcast(self, value):
        if self.group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def close(self) -> None:
        self.wait()
        if self.stager is not None:
            self.stager.close()
            self.stager = None
        for group in (self.group, self.poll_group):
            if group is not None:
                dist.destroy_process_group(group)
        self.group = self.poll_group = None
