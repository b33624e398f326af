"""Both checkpoint tiers behind one object. Storage: sharded checkpoints through DCP, saved in two stages (MegaScale,
Jiang et al. 2024): stage 1 copies the state to host memory and training resumes; stage 2 writes to storage and
commits in the background. At most one save is in flight; a checkpoint counts once every rank finished and rank 0
wrote the commit marker; loading takes the newest intact one and reshards it into the layout running now. Memory:
the optional in-memory tier (`MemoryTier`) snapshots every few steps. The manager owns the policy too: when to
save (a fixed or a Young/Daly interval, and at least every checkpoint.interval_minutes, decided alike on every rank),
what a failed save does (reported, training goes on), the memory tier turning off when shared memory is short, the
protected final save, and which tier a resume loads from.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from scaletrain.checkpoint.integrity import (
    checkpoint_steps,
    committed_steps,
    newest_intact,
    step_path,
    write_commit,
)
from scaletrain.checkpoint.interval import interval_steps, slowest_rank
from scaletrain.checkpoint.memory_tier import (
    MemoryTier,
    SnapshotFailed,
    job_key,
    make_layout_key,
    snapshot_bytes,
)
from scaletrain.checkpoint.safe_load import make_reader, read_metadata
from scaletrain.config import CheckpointConfig
from scaletrain.errors import UserError
from scaletrain.parallel.mesh import any_rank, broadcast_object
from scaletrain.run.directory import RunDir

log = logging.getLogger("scaletrain")
# What a failed write raises: OSError from our own file operations, CheckpointException (a BaseException) from
# DCP, which gathers every rank's write errors and raises it on all of them.
SAVE_ERRORS = (OSError, CheckpointException)
AUTO_PROBE_STEPS = 5  # checkpoint.interval = auto measures a save this many steps into every run segment


def _writer(path: str, step: int):
    return FsspecWriter(path) if "://" in path else FileSystemWriter(path)


def staging_options(device_type: str) -> StagingOptions:
    """How an async save copies the state to host memory: into pinned buffers with non-blocking copies from a
    GPU (the copy overlaps the next forward), plain copies on a CPU device (nothing to pin; a CPU run on a GPU host
    must not open a CUDA context)."""
    cuda = device_type == "cuda"
    return StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda
    )


@functools.cache
def stager_reusable() -> bool:
    """Whether one DefaultStager stages more than once. torch 2.11's closes its copier at the end of every stage, so
    the next save dies in DCP's stager with `KeyError: <class 'type'>` (pytorch/pytorch#183413, fixed in a later
    release). Probed once, on two tiny synchronous stages, so that no torch version number is hard-coded."""
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        for _ in range(2):
            stager.stage({"probe": torch.zeros(1)})
        return True
    except KeyError:
        return False
    finally:
        stager.close()


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
        memory: MemoryTier | None = None,
        memory_interval: int = 0,
        device_type: str = "cpu",
        control: dist.ProcessGroup | None = None,
        start_over: bool = False,
    ):
        self.cfg = cfg
        self.start_over = start_over  # run.start_over: no intact checkpoint is no reason to refuse
        self.enabled = (
            cfg.enabled
        )  # storage checkpoints; a disabled manager saves nothing and loads only memory
        self.root = root.rstrip("/")
        self.fs, _ = fsspec.core.url_to_fs(self.root)
        self.state = state
        self.rank = rank
        self.event = event
        self.memory, self.memory_interval = memory, memory_interval
        self.device_type = device_type
        # The CPU control group (dims.control): the decisions every rank must make alike (when to save) are agreed
        # over it, in the training thread. None in a single process.
        self.control = control
        agree = self.enabled and (cfg.interval == "auto" or cfg.interval_minutes > 0)
        assert world_size == 1 or control is not None or not agree, "saving decisions need the control group"
        # Set up by fault injection at setup: the storage writer factory and callbacks after each commit.
        self.make_writer: Callable[[str, int], object] = _writer
        # checkpoint.interval_minutes' clock (a test sets one).
        self.clock: Callable[[], float] = time.monotonic
        self._since: float | None = None  # the clock when the last save started (or the segment's first step)
        self._room_checked = False  # the memory tier's room in shared memory, checked at the first step
        self.on_commit: list[Callable[[int, str], object]] = []
        self.stalls: dict[int, float] = {}  # step -> seconds the save blocked training
        # The longest save so far, from its start to its commit (seconds): what run.time_limit keeps for the final one.
        self.save_seconds = 0.0
        self._save_started = 0.0
        # Saves talk over a gloo group of their own: their collectives run in background threads and must never
        # interleave with the training thread's on another group (control plane or device mesh).
        distributed = world_size > 1 and (self.enabled or memory is not None)
        self.group = dist.new_group(backend="gloo") if distributed else None
        self.pending: tuple[int, Future] | None = None  # (step, the background upload + commit)
        self.staging: Future | None = None
        self.stager = None
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-commit") if self.enabled else None
        self.last_source = "none"
        self.commit_thread = ""
        self._last_snapshot: int | None = None  # the newest memory snapshot this process took or restored
        self.interval = cfg.interval if isinstance(cfg.interval, int) else 0
        self._probe_at: int | None = None
        self._segment: tuple[int, float] = (
            0,
            time.perf_counter(),
        )  # (first step, its time) of this run segment

    # -- policy: what the training loop calls ------------------------------------------------------------------
    def maybe_save(self, step: int) -> float:
        """Snapshot to memory and save to storage when due; commit a save that finished in the background. Returns
        the seconds training was blocked (a stall, not step time)."""
        blocked = 0.0
        if self.memory is not None and not self._room_checked:
            blocked += self._check_memory_room(step)
        memory_on = self.memory is not None and self.memory.off is None
        if memory_on and self.memory_interval and step % self.memory_interval == 0:
            blocked += self._snapshot(step)
        if self.enabled:
            if self._since is None:
                self._since = self.clock()
            # Every rank takes the same branch: the interval and the probe step are agreed, _time_due() agrees.
            if step == self._probe_at:
                blocked += self._probe_interval(step)
            elif (self.interval and step % self.interval == 0) or self._time_due():
                self._since = self.clock()
                blocked += self.try_save(step) or 0.0
            self.poll()
        return blocked

    def _time_due(self) -> bool:
        """checkpoint.interval_minutes have passed since the last save started, on some rank's clock: agreed like
        run.time_limit and SIGTERM (any_rank: one small all-reduce over the CPU control group per step), so that
        every rank saves after the same step."""
        if not self.cfg.interval_minutes:
            return False
        return any_rank(self.clock() - self._since >= self.cfg.interval_minutes * 60, self.control)

    def try_save(self, step: int, *, blocking: bool = False) -> float | None:
        """Start a save; a failing one (e.g. a full disk) is reported and training goes on: the previous checkpoint
        is untouched. Returns the seconds training was blocked, None when the save failed."""
        try:
            return self.save(step, blocking=blocking)
        except SAVE_ERRORS as e:
            self._report_failure(step, e)
            return None

    def final_save_note(self) -> str:
        return "saving a checkpoint" if self.enabled else "checkpoint.enabled = false: nothing is saved"

    def close(self, step: int, *, finished: bool = True) -> None:
        """The final save of `step`, protected: the memory tier first holds a snapshot of it, and its snapshots are
        removed only once the run finished and the storage checkpoint is committed, so a crash or a full disk
        during the final save loses nothing (the next start resumes from memory). The tier never stands before the
        storage save: a snapshot that fails turns the tier off and the save goes on. Raises UserError when the final
        save failed."""
        if self.memory is not None and self.memory.off is None and self._last_snapshot != step:
            self._snapshot(step)
        saved = True
        if self.enabled:
            self.poll()
            if step not in self.committed_steps() and (self.pending is None or self.pending[0] != step):
                saved = self.try_save(step, blocking=True) is not None
            saved = self.wait() and saved and step in self.committed_steps()
        if self.memory is not None:
            if saved and finished:
                self.memory.cleanup()
            self.memory.close()
        self.shutdown()
        if not saved:
            kept = ""
            if self.memory is not None and self._last_snapshot is not None:
                kept = f"the in-memory snapshot of step {self._last_snapshot} is kept: run again to resume from it"
            raise UserError(
                f"the final checkpoint of step {step} failed (see events.jsonl); {kept or 'nothing saved'}"
            )

    def _probe_interval(self, step: int) -> float:
        """checkpoint.interval = auto: save once to measure what a save costs (delta), then pick the Young/Daly
        interval from it. On CPU the background write competes with training for the same cores, so delta is the
        whole save (written synchronously); on a GPU it is what the save blocks. Every rank measures its own
        figures; the interval comes from the slowest rank's (agreed over the control group), so that all choose the
        same one: ranks that rounded to different intervals would save at different steps and wait in the save's
        collectives forever."""
        first, t0 = self._segment
        step_time = (time.perf_counter() - t0) / max(1, step - first)
        cpu = self.device_type == "cpu"
        self._since = self.clock()
        stall = self.try_save(step, blocking=cpu)
        failed, delta, step_time = slowest_rank([float(stall is None), stall or 0.0, step_time], self.control)
        if failed:
            self._probe_at = step + AUTO_PROBE_STEPS  # the probe failed on some rank: try again later
            return stall or 0.0
        self.interval = interval_steps(delta, self.cfg.mtbf_hours * 3600, step_time)
        self._probe_at = None
        log.info(
            "checkpoint.interval = auto: a save costs %.3fs (%s, slowest rank), MTBF %.2fh, step %.3fs -> every %d "
            "steps",
            delta,
            "whole save, CPU" if cpu else "blocking part",
            self.cfg.mtbf_hours,
            step_time,
            self.interval,
        )
        self.event(
            "checkpoint_interval",
            step=step,
            cost_s=delta,
            cost="whole save" if cpu else "blocking",
            mtbf_hours=self.cfg.mtbf_hours,
            step_time_s=step_time,
            interval_steps=self.interval,
        )
        return stall

    def _check_memory_room(self, step: int) -> float:
        """At the first step of a run segment (the optimizer's state exists then): turn the memory tier off now when
        no snapshot fits in some node's free shared memory, warn when the next will not fit beside the one kept.
        Returns the seconds it took."""
        t0 = time.perf_counter()
        self._room_checked = True
        off, next_short = self.memory.check_room(snapshot_bytes(self.state))
        if off is not None:
            self._memory_off(step)
        elif next_short is not None and self.rank == 0:
            log.warning("memory tier: %s: it turns off at its second snapshot", next_short)
        return time.perf_counter() - t0

    def _memory_off(self, step: int) -> None:
        """The memory tier turned itself off (no room in shared memory, a failed write): say why, once."""
        storage = "storage checkpoints go on" if self.enabled else "checkpoint.enabled = false: no storage"
        if self.rank == 0:
            log.warning("memory tier off from step %d (%s): %s", step, storage, self.memory.off)
        self.event("memory_tier_off", step=step, reason=self.memory.off)

    def _snapshot(self, step: int) -> float:
        t0 = time.perf_counter()
        try:
            taken = self.memory.snapshot(step, self.state)
        except SnapshotFailed:  # on every rank alike; the previous snapshot stays
            self._memory_off(step)
            return time.perf_counter() - t0
        if taken:
            self._last_snapshot = step
            self.event(
                "memory_snapshot", step=step, seconds=time.perf_counter() - t0, bytes=self.memory.bytes_used()
            )
        return time.perf_counter() - t0

    def _report_failure(self, step: int, e: BaseException) -> None:
        self.event("checkpoint_failed", step=step, error=str(e).strip()[:2000])
        log.error(
            "step %d: checkpoint save failed (%s); training continues, the previous checkpoint stays",
            step,
            str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__,
        )

    # -- saving ------------------------------------------------------------------------------------------------
    def path(self, step: int) -> str:
        return step_path(self.root, step)

    def save(self, step: int, *, blocking: bool = False) -> float:
        """Save the state at `step`; return how long training was blocked (seconds). Raises SAVE_ERRORS."""
        t0 = time.perf_counter()
        in_flight = self.pending is not None
        self.wait()
        # This save's own time starts when the previous one is over (save_seconds estimates one save).
        self._save_started = time.perf_counter() if in_flight else t0
        path = self.path(step)
        if self.rank == 0:
            self.fs.makedirs(path, exist_ok=True)
        self._barrier()
        writer = self.make_writer(path, step)
        no_dist = self.group is None
        if self.cfg.async_save and not blocking:
            # Stage 1 (the copy to host memory) runs in a thread beside the next forward/backward, which does not
            # change the weights; before_update() waits for it before the optimizer does.
            if self.stager is not None and not stager_reusable():
                self.stager.close()  # its stage is over (wait() above); a fresh one per save, pinned anew
                self.stager = None
            if self.stager is None:
                self.stager = DefaultStager(staging_options(self.device_type))
            if self.device_type == "cuda":
                # The stager copies on a stream of its own, which nothing orders after the optimizer's kernels:
                # without this wait a save may copy weights the queued update has not written yet.
                torch.cuda.current_stream().synchronize()
            resp = dcp.async_save(
                self.state,
                storage_writer=writer,
                process_group=self.group,
                no_dist=no_dist,
                async_stager=self.stager,
            )
            self.staging = getattr(resp, "staging_completion", None)
            upload = getattr(resp, "upload_completion", resp)
            # The commit (a checksum of every file, the marker, retention) follows the upload in a thread of its
            # own: it is storage work, not training's, and must not run in (or count as) the training thread.
            self.pending = (step, self._committer.submit(self._commit_after, step, upload))
        else:
            dcp.save(self.state, storage_writer=writer, process_group=self.group, no_dist=no_dist)
            self._commit(step)
        stall = time.perf_counter() - t0
        # A save is not over before save() returns, even if its writes and commit already finished beside it.
        self.save_seconds = max(self.save_seconds, time.perf_counter() - self._save_started)
        self.stalls[step] = self.stalls.get(step, 0.0) + stall
        if self.pending is None:  # saved synchronously: committed and reported now
            self._report_saved(step, 0.0)
        return stall

    def before_update(self) -> float:
        """Block until stage 1 of the save in flight has copied the state (call before the optimizer changes it);
        return the seconds waited."""
        if self.staging is None:
            return 0.0
        t0 = time.perf_counter()
        self.staging.result()
        self.staging = None
        waited = time.perf_counter() - t0
        if self.pending is not None:
            self.stalls[self.pending[0]] = self.stalls.get(self.pending[0], 0.0) + waited
        return waited

    def poll(self) -> None:
        """Report the save in flight once its background commit is done (a local check: no collective)."""
        if self.pending is not None and self.pending[1].done():
            self.wait()

    def wait(self) -> bool:
        """Finish the save in flight (if any): wait for its upload and commit; report it. False when it failed."""
        self.before_update()
        if self.pending is None:
            return True
        step, fut = self.pending
        self.pending = None
        try:
            commit_s = fut.result()
        except SAVE_ERRORS as e:
            self.stalls.pop(step, None)
            self._report_failure(step, e)
            return False
        self._report_saved(step, commit_s)
        return True

    def _commit_after(self, step: int, upload: Future) -> float:
        """Background thread: wait for every rank's files, then commit. Returns the seconds the commit took."""
        upload.result()  # raises CheckpointException on every rank when any rank's write failed
        t0 = time.perf_counter()
        self._commit(step)
        return time.perf_counter() - t0

    def _commit(self, step: int) -> None:
        self.commit_thread = threading.current_thread().name  # where commits run (a test reads it)
        self._barrier()  # every rank finished writing its shards
        if self.rank == 0:
            write_commit(self.fs, self.path(step), {"step": step})
            self._retain()
        self._barrier()
        self.save_seconds = max(self.save_seconds, time.perf_counter() - self._save_started)

    def _report_saved(self, step: int, commit_s: float) -> None:
        """Rank 0 runs the commit callbacks and writes the event (the stall of this save: its blocking part)."""
        if self.rank == 0:
            for callback in self.on_commit:
                callback(step, self.path(step))
            self.event(
                "checkpoint_saved",
                step=step,
                path=self.path(step),
                blocking_s=self.stalls.pop(step, 0.0),
                background_commit_s=commit_s,
            )
        else:
            self.stalls.pop(step, None)

    def _retain(self) -> None:
        """Keep the newest keep_last committed checkpoints plus every keep_every-th; drop older partial saves."""
        steps = self.committed_steps()
        keep = set(steps[-self.cfg.keep_last :]) if self.cfg.keep_last > 0 else set(steps)
        if self.cfg.keep_every > 0:
            keep |= {s for s in steps if s % self.cfg.keep_every == 0}
        newest = steps[-1] if steps else -1
        for s in checkpoint_steps(self.fs, self.root):
            if s not in keep and s < newest:
                self.fs.rm(self.path(s), recursive=True)

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    # -- loading -----------------------------------------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        return committed_steps(self.fs, self.root)

    def load_latest(self) -> int | None:
        """Load the newest complete copy across tiers into the state: the memory snapshot when it is at least as
        new as the newest committed storage checkpoint (and of the same layout), else the newest intact storage
        checkpoint (which reshards into any layout), else an older memory snapshot. Returns its step, None when
        there is none. Raises UserError when the run has committed checkpoints and none of either tier is intact
        (unless run.start_over): a run never silently starts over."""
        self.wait()
        mem = self.memory.latest_complete_step() if self.memory is not None else None
        stored = self.committed_steps()[-1:] if self.enabled else []
        if mem is not None and (not stored or mem >= stored[0]):
            return self._load_memory(mem)
        step = self._load_storage(refuse=mem is None) if self.enabled else None
        if step is None and mem is not None:
            return self._load_memory(mem)
        if step is None and self.memory is not None and self.rank == 0:
            self._say_unusable_snapshot()
        return self._loaded(step, "storage" if step is not None else "none")

    def _say_unusable_snapshot(self) -> None:
        """A start from step 0 beside a snapshot of this run in another layout (after a re-formed job changed the
        world size and before storage held a checkpoint): a warning and a `memory_snapshot_unusable` event."""
        other = self.memory.other_layout_step()
        if other is None:
            return
        step, layout = other
        saved = "has no committed checkpoint" if self.enabled else "is off (checkpoint.enabled false)"
        log.warning("the memory tier holds step %d taken as %s, which it cannot reshard into this job's layout "
                    "(%s), and storage %s: training starts again from step 0. Storage checkpoints reshard: set "
                    "checkpoint.interval so one exists before a node can be lost", step, layout,
                    self.memory.layout_key, saved)  # fmt: skip
        self.event("memory_snapshot_unusable", step=0, snapshot_step=step, snapshot_layout=layout,
                   layout=self.memory.layout_key, storage=saved)  # fmt: skip

    def _load_memory(self, step: int) -> int:
        self.memory.restore(step, self.state)
        hosts = self.memory.hosts
        # Where each rank's state came from: its own node's memory, except these, which took their replica from
        # another node (after a lost node: the survivors' memory).
        peers = [{"rank": r, "node": hosts[r], "from_rank": h, "from_node": hosts[h]}
                 for r, h in sorted(self.memory.restored_from.items())]  # fmt: skip
        self.event("checkpoint_loaded", step=step, source="memory", from_peers=peers,
                   seconds=self.memory.last_restore_s)  # fmt: skip
        log.info("resumed from the in-memory snapshot of step %d (%.2fs)", step, self.memory.last_restore_s)
        self._last_snapshot = step
        return self._loaded(step, "memory")

    def _loaded(self, step: int | None, source: str) -> int | None:
        self.last_source = source
        start = step or 0
        self._segment = (start, time.perf_counter())
        # Probed in every run segment, so a restarted worker measures again rather than never saving.
        self._probe_at = start + AUTO_PROBE_STEPS if self.cfg.interval == "auto" else None
        return step

    def _load_storage(self, refuse: bool) -> int | None:
        """The newest intact storage checkpoint. One that fails its check is skipped in favour of the one before
        it, and a committed one is then moved aside (rejected-step-N-<time>: kept for a look, and out of the way of
        a later save of the same step). `refuse`: raise UserError, moving nothing, when committed checkpoints exist
        and none is intact (unless run.start_over)."""
        rejected = []  # (step, reason) of the committed checkpoints that failed their check
        choice = None
        if self.rank == 0:
            choice, failed = newest_intact(self.fs, self.root)
            for step, reason, committed in failed:
                log.warning("checkpoint %s skipped: %s", self.path(step), reason)
                self.event("checkpoint_rejected", step=step, path=self.path(step), reason=reason)
                if committed:  # committed, then damaged
                    rejected.append((step, reason))
        choice, rejected = broadcast_object((choice, rejected), self.group)
        if choice is None and rejected and refuse and not self.start_over:
            memory = "holds no complete snapshot of it" if self.memory is not None else "is off"
            raise UserError(
                "this run has checkpoints but none is intact, so it cannot continue (nothing was changed):\n"
                + "".join(f"  {self.path(s)}: {reason}\n" for s, reason in rejected)
                + f"  the in-memory tier {memory}\nRestore a checkpoint, or add --run.start_over true to train "
                "the run again from step 0 (the damaged checkpoints are then kept aside as rejected-step-N)"
            )
        if self.rank == 0:
            for step, reason in rejected:
                aside = f"{self.root}/rejected-step-{step:08d}-{time.strftime('%Y%m%d-%H%M%S')}"
                self.fs.mv(self.path(step), aside, recursive=True)
                self.event("checkpoint_moved_aside", step=step, path=aside, reason=reason)
        if choice is None:
            return None
        path = self.path(choice)
        train_state = self.state.get("train")
        if train_state is not None:
            saved = read_metadata(path).state_dict_metadata
            train_state.saved_ranks = saved["train.rng"].size[0]
            cuda_rng = saved.get(
                "train.cuda_rng"
            )  # absent: saved on CPU, or before CUDA RNG states were saved
            train_state.saved_cuda_shape = tuple(cuda_rng.size) if cuda_rng is not None else None
        dcp.load(
            self.state, storage_reader=make_reader(path), process_group=self.group, no_dist=self.group is None
        )
        if self.rank == 0:
            self.event("checkpoint_loaded", step=choice, path=path, source="storage")
        log.info("resumed from %s", path)
        return choice

    def shutdown(self) -> None:
        """Release the stager, the commit thread and the save group (close() does it after the final save)."""
        if self.stager is not None:
            self.stager.close()
            self.stager = None
        if self._committer is not None:
            self._committer.shutdown(wait=True)
            self._committer = None
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


def has_committed_checkpoint(root: str) -> bool:
    fs, _ = fsspec.core.url_to_fs(root)
    return bool(committed_steps(fs, root))


def build_checkpointing(
    cfg: CheckpointConfig,
    run: RunDir,
    run_id: str,
    state: dict,
    env,
    group: dist.ProcessGroup | None,
    layout: str,
    event: Callable[..., None],
    start_over: bool = False,
    hosts: list[str] | None = None,
) -> CheckpointManager:
    """Both tiers for a run: storage (DCP, when checkpoint.enabled) and the in-memory snapshot tier (when
    checkpoint.snapshot_interval > 0). `group` is the CPU control group; memory snapshots and the saving decisions
    use it, as they run in the training thread between steps. `start_over`: run.start_over. `hosts`: each rank's node,
    where the memory tier places each rank's replica on another."""
    memory = None
    if cfg.snapshot_interval > 0:
        memory = MemoryTier(
            job_key(run.path, run_id),
            make_layout_key(env.world_size, layout),
            group=group,
            max_bytes=cfg.snapshot_max_mb << 20,
            ttl_s=cfg.snapshot_ttl_hours * 3600,
            hosts=hosts,
        )
    return CheckpointManager(
        cfg,
        run.checkpoint_root(cfg, run_id),
        state,
        rank=env.rank,
        world_size=env.world_size,
        event=event,
        memory=memory,
        memory_interval=cfg.snapshot_interval,
        device_type=env.device.type,
        control=group,
        start_over=start_over,
    )
