"""The memory tier's folders in shared memory, kept private: /dev/shm is writable by every user, so each user gets
a root of their own (mode 0700, files 0600), a root that is a link or another user's is refused, and the TTL
cleanup never follows or deletes a link (issue 10, item 8). And the room there: containers get little shared memory
(Docker: 64 MiB), so the tier checks whether its snapshots fit before it writes them (issue 21, item 8)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path

from scaletrain.errors import UserError

log = logging.getLogger("scaletrain")

# rmtree on this platform removes a tree by file descriptors: it never follows a link below its top, and refuses
# a top that is a link. Without that guarantee (some platforms lack it) the cleanup removes nothing.
_SAFE_RMTREE = shutil.rmtree.avoids_symlink_attacks
SHM_ADVICE = (
    "give the job more shared memory (docker run --shm-size=8g; Kubernetes: an emptyDir volume with medium: Memory "
    "mounted at /dev/shm; Slurm: a node whose /dev/shm holds it), or set checkpoint.snapshot_interval = 0"
)


def default_root() -> Path:
    """/dev/shm/scaletrain-<uid> where /dev/shm exists (Linux); elsewhere a temp dir, not memory but it works."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"scaletrain-{os.getuid()}"


def private_dir(path: Path) -> Path:
    """Create `path` with mode 0700 where missing; check that it is a real directory (not a link) of this user."""
    with contextlib.suppress(FileExistsError):  # a dangling link there: the check below says so
        os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UserError(
            f"memory tier root {path} is a symbolic link or not a directory: another user may have planted it. "
            f"Remove it (rm {path}) and rerun"
        )
    if st.st_uid != os.getuid():
        raise UserError(
            f"memory tier root {path} belongs to user id {st.st_uid}, not to you ({os.getuid()}): that user could "
            "read or replace snapshots there. Ask them or an administrator to remove it, then rerun"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)  # checked above to be our own directory, not a link
    return path


def restrict_files(d: Path) -> None:
    """Make the regular files in `d` readable by their owner only (links and folders are left alone)."""
    for entry in os.scandir(d):
        if entry.is_file(follow_symlinks=False):
            os.chmod(entry.path, 0o600)


def remove_stale_jobs(root: Path, ttl_s: float, keep: str = "") -> list[str]:
    """Remove the snapshots of jobs that wrote nothing for `ttl_s` seconds: a job that crashed for good (or whose
    launcher gave up) leaves its snapshots in shared memory, where nothing else frees them. Age, not a liveness
    check, decides, because a job's run directory may live on another node: a job queued longer than the TTL
    resumes from storage instead. Only real directories of this user are looked at or removed: a link (which a
    user could point at someone else's folder) is skipped, never followed. Returns the removed job keys."""
    removed = []
    now = time.time()
    try:
        private_dir(root)
        entries = list(os.scandir(root))
    except (OSError, UserError):
        return removed
    for job in entries:
        with contextlib.suppress(OSError):
            st = job.stat(follow_symlinks=False)
            if job.name == keep or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            # A snapshot creates or removes a step directory inside a slot, which updates the slot's mtime.
            newest = max(
                [st.st_mtime] + [s.stat(follow_symlinks=False).st_mtime for s in os.scandir(job.path)]
            )
            if now - newest > ttl_s and _SAFE_RMTREE:
                shutil.rmtree(job.path, ignore_errors=True)
                removed.append(job.name)
                log.info(
                    "memory tier: removed stale snapshots of job %s (idle %.1f h)",
                    job.name,
                    (now - newest) / 3600,
                )
    return removed


def node_room(root: Path) -> tuple[int, int]:
    """(an id of the shared memory `root` is in: its host and device, the bytes free there)."""
    st = os.statvfs(root)
    node = hashlib.sha256(f"{socket.gethostname()}|{os.stat(root).st_dev}".encode()).digest()
    return int.from_bytes(node[:7], "big"), st.f_bavail * st.f_frsize


def shortfall(rows: list[list[int]], held: list[int], copies: int, root: Path) -> str | None:
    """Why `copies` generations of snapshots do not fit in some node's shared memory, None when they fit. `rows`:
    per rank (snapshot size, node, free bytes, bytes the job holds there now); `held`: per rank, what it keeps of one
    generation (own copy and replica). The ranks of a node share its memory; the job's snapshots there now are one
    of the generations."""
    need: dict[int, int] = {}
    room: dict[int, int] = {}
    for r, (_, node, free, have) in enumerate(rows):
        need[node] = need.get(node, 0) + copies * held[r]
        room[node] = min(room.get(node, free + have * (copies - 1)), free + have * (copies - 1))
    for node, n in need.items():
        if n > room[node]:
            ranks = [r for r, row in enumerate(rows) if row[1] == node]
            what = "a snapshot" if copies == 1 else "a new snapshot beside the one kept"
            return (
                f"{what} needs {n / 2**20:.1f} MiB in {root} on the node of ranks {ranks} (each rank's own copy and "
                f"the replica it holds), which has {room[node] / 2**20:.1f} MiB free"
            )
    return None
