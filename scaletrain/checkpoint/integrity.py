"""Commit markers and checksums: a checkpoint counts only once `commit.json` (with a sha256 per file) exists, and
it is loaded only if every file still matches."""

from __future__ import annotations

import hashlib
import json
import re
import time

import fsspec

COMMIT = "commit.json"
_STEP_DIR = re.compile(r"step-(\d{8})$")


def _sha256(fs: fsspec.AbstractFileSystem, path: str) -> str:
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_commit(fs: fsspec.AbstractFileSystem, ckpt_dir: str, info: dict) -> None:
    """Checksum every file, then write the marker atomically (write aside, rename): a crash at any point leaves
    either no marker or a complete one. Files are named relative to the checkpoint folder."""
    files = {}
    for path in sorted(fs.find(ckpt_dir)):
        name = relative_name(fs, ckpt_dir, path)
        if name != COMMIT and not name.endswith(".tmp"):
            files[name] = {"size": fs.size(path), "sha256": _sha256(fs, path)}
    body = json.dumps({**info, "time": time.time(), "files": files}, indent=1)
    tmp = f"{ckpt_dir}/{COMMIT}.tmp"
    with fs.open(tmp, "w") as f:
        f.write(body)
    fs.mv(tmp, f"{ckpt_dir}/{COMMIT}")


def relative_name(fs: fsspec.AbstractFileSystem, ckpt_dir: str, path: str) -> str:
    """`path` (as fs.find lists it) relative to `ckpt_dir` (as the user gave it). fsspec lists paths in its own
    form: absolute and without the protocol (a relative local folder, file://, memory://, s3://bucket/...), so the
    folder is put in that form before it is cut off."""
    root = fs._strip_protocol(ckpt_dir).rstrip("/")
    if not path.startswith(root + "/"):
        raise ValueError(f"{path} is not inside the checkpoint {ckpt_dir}")
    return path[len(root) + 1 :]


def read_commit(fs: fsspec.AbstractFileSystem, ckpt_dir: str) -> dict | None:
    path = f"{ckpt_dir}/{COMMIT}"
    if not fs.exists(path):
        return None
    try:
        with fs.open(path, "r") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError):
        return None


def verify(fs: fsspec.AbstractFileSystem, ckpt_dir: str) -> str | None:
    """None when the checkpoint is committed and intact, else the reason it is not."""
    commit = read_commit(fs, ckpt_dir)
    if commit is None:
        return "no commit marker (the save did not finish)"
    files = commit.get("files") if isinstance(commit, dict) else None
    if not isinstance(files, dict):
        return f"{COMMIT} lists no files (written by something else, or damaged)"
    for name, want in files.items():
        path = f"{ckpt_dir}/{name}"
        if not fs.exists(path):
            return f"{name} is missing"
        if fs.size(path) != want["size"]:
            return f"{name} has {fs.size(path)} bytes, {want['size']} were written (truncated?)"
        if _sha256(fs, path) != want["sha256"]:
            return f"{name} does not match its checksum (corrupted)"
    return None


def step_path(root: str, step: int) -> str:
    """The folder of the checkpoint of `step` under a run's checkpoint root."""
    return f"{root.rstrip('/')}/step-{step:08d}"


def checkpoint_steps(fs: fsspec.AbstractFileSystem, root: str) -> list[int]:
    """The steps of every checkpoint folder under `root`, committed or not, oldest first."""
    if not fs.exists(root):
        return []
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
    return sorted(int(m.group(1)) for n in names if (m := _STEP_DIR.match(n)))


def committed_steps(fs: fsspec.AbstractFileSystem, root: str) -> list[int]:
    return [s for s in checkpoint_steps(fs, root) if read_commit(fs, step_path(root, s)) is not None]


def newest_intact(fs: fsspec.AbstractFileSystem, root: str) -> tuple[int | None, list[tuple[int, str, bool]]]:
    """The newest checkpoint under `root` that is committed and intact (None when there is none), and each newer
    one that is not: (step, the reason, whether it was committed — a committed one was damaged after its save)."""
    failed = []
    for step in reversed(checkpoint_steps(fs, root)):
        reason = verify(fs, step_path(root, step))
        if reason is None:
            return step, failed
        failed.append((step, reason, read_commit(fs, step_path(root, step)) is not None))
    return None, failed
