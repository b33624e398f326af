"""Commit markers and checksums: a checkpoint counts only once `commit.json` (with a sha256 per file) exists, and
it is loaded only if every file still matches."""

from __future__ import annotations

import hashlib
import json
import time

import fsspec

COMMIT = "commit.json"


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
    for name, want in commit["files"].items():
        path = f"{ckpt_dir}/{name}"
        if not fs.exists(path):
            return f"{name} is missing"
        if fs.size(path) != want["size"]:
            return f"{name} has {fs.size(path)} bytes, {want['size']} were written (truncated?)"
        if _sha256(fs, path) != want["sha256"]:
            return f"{name} does not match its checksum (corrupted)"
    return None
