"""Where streamed shards come from: a source's files listed through fsspec (local paths, file://, s3://, gs://, ...),
with S3 endpoints and credentials found the way AWS tools find them; and a bounded local cache that fetches remote
shards ahead of use and retries a failed fetch, so a read is whole or not at all.

Local files are read where they lie (no copy); remote ones land in the cache whole, written aside and renamed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import fsspec

from scaletrain.config import SourceConfig
from scaletrain.errors import UserError

log = logging.getLogger("scaletrain")

# A fetch or a listing that fails (a connection dropped, the store restarting) is tried again after 0.5, 1, 2, 4,
# 8 s: ~15 s of an outage is ridden out; a longer one stops the run (or refuses the source) with the URL and the reason.
FETCH_ATTEMPTS = 6
_BACKOFF_S = 0.5
_GLOB_CHARS = set("*?[")
# Answers a listing does not retry, since asking again cannot change them: what is not there, what is forbidden, a
# bad URL, and botocore's configuration errors (named: botocore is an optional dependency).
_FINAL_ERRORS = (FileNotFoundError, PermissionError, NotADirectoryError, ValueError, ImportError)
_FINAL_NAMES = {"ProfileNotFound", "NoCredentialsError", "PartialCredentialsError", "InvalidConfigError"}

T = TypeVar("T")


def retried(
    call: Callable[[], T], what: str, final: Callable[[Exception], bool] = lambda e: False, attempts: int = 0
) -> T:
    """`call()`, tried again on failure after 0.5, 1, 2, 4, 8 s (`attempts` in all, FETCH_ATTEMPTS by default),
    each failure logged as a warning naming `what`; the last failure, or one that `final` says asking again cannot
    change, is raised."""
    attempts = attempts or FETCH_ATTEMPTS
    for attempt in range(attempts):
        try:
            return call()
        except Exception as e:
            if attempt == attempts - 1 or final(e):
                raise
            wait = _BACKOFF_S * 2**attempt
            log.warning("%s failed (%s: %s); trying again in %.1f s", what, type(e).__name__, e, wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


def _final(e: Exception) -> bool:
    return isinstance(e, _FINAL_ERRORS) or any(c.__name__ in _FINAL_NAMES for c in type(e).__mro__)


def _patience(fs: fsspec.AbstractFileSystem) -> tuple[int, str]:
    """How often we try a request to `fs`, and how often it was asked in all, in words. gcsfs retries each request
    itself (6 tries, 1 to 32 s apart: ~40 s against a closed port), so we try once there: the two multiplied to
    minutes before a dead endpoint was refused. s3fs is made to try once (storage_options), so we retry it."""
    if "gs" in ((fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol):
        return 1, "asked 6 times by gcsfs"
    span = _BACKOFF_S * (2 ** (FETCH_ATTEMPTS - 1) - 1)
    return FETCH_ATTEMPTS, f"asked {FETCH_ATTEMPTS} times over {span:g} s"


@dataclass(frozen=True, order=True)
class Shard:
    """One file of a source: its URL as fsspec names it (protocol included for remote ones), its size, and a tag
    of its version where the store gives one (S3's ETag, a file's mtime): part of its token count's key."""

    url: str
    size: int
    tag: str = ""


def storage_options(src: SourceConfig) -> dict:
    """fsspec options of a source. S3 endpoint and credentials come from the config when set there, else from what
    botocore reads itself: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws. A GCS
    endpoint comes from the config, else gcsfs reads STORAGE_EMULATOR_HOST; its credentials are Google's application
    default ones (GOOGLE_APPLICATION_CREDENTIALS, gcloud's, the metadata server), anonymous where there are none."""
    if _is_gcs(src.path):
        return {"endpoint_url": src.endpoint_url} if src.endpoint_url else {}
    if not src.path.startswith("s3://"):
        return {}
    # One attempt per request: ShardCache retries a failed fetch with its own backoff, and a store that cannot be
    # listed at launch is refused at once (botocore's own retries took 14 s to say that a port was closed).
    opts: dict = {"config_kwargs": {"retries": {"max_attempts": 1}}}
    if src.endpoint_url:
        opts["endpoint_url"] = src.endpoint_url
    if src.profile:
        opts["profile"] = src.profile
    return opts


def _endpoint_fix(src: SourceConfig, where: str) -> str:
    """Where a remote source's endpoint and credentials come from, for a message about a source that cannot be listed."""
    if src.path.startswith("s3://"):
        return (f"; S3 reads AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or "
                f"{where}.endpoint_url and {where}.profile")  # fmt: skip
    if _is_gcs(src.path):
        return (f"; GCS reads STORAGE_EMULATOR_HOST or {where}.endpoint_url, and Google's application default "
                "credentials (GOOGLE_APPLICATION_CREDENTIALS, gcloud auth application-default login)")  # fmt: skip
    return ""


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _is_gcs(path: str) -> bool:
    return path.startswith(("gs://", "gcs://"))


def source_filesystem(src: SourceConfig, index: int) -> fsspec.AbstractFileSystem:
    """A filesystem of the source's own, made now: not fsspec's cached instance, which keeps the endpoint and
    credentials of the environment it was made in. Nothing is contacted yet."""
    try:
        if _is_gcs(src.path):
            # gcsfs's JSON-API filesystem: a listing and whole-object reads are all a source needs. The class fsspec
            # maps gs:// to since gcsfs 2026.x first asks the storage-control API (gRPC) for each bucket's layout,
            # which emulators do not serve (60 s of timeouts a bucket, anonymously) and which needs a permission
            # of its own.
            from gcsfs.core import GCSFileSystem

            return GCSFileSystem(skip_instance_cache=True, **storage_options(src))
        return fsspec.core.url_to_fs(src.path, skip_instance_cache=True, **storage_options(src))[0]
    except ImportError as e:  # fsspec's "Install s3fs to access S3"; gcsfs missing
        if _is_gcs(src.path):
            raise UserError(
                f"data.sources[{index}].path {src.path}: gs:// is read through gcsfs: pip install gcsfs"
            ) from None
        raise UserError(
            f"data.sources[{index}].path {src.path}: {e} (pip install 'scaletrain[stream]')"
        ) from None


def list_shards(src: SourceConfig, index: int, fs: fsspec.AbstractFileSystem | None = None) -> list[Shard]:
    """The files a source names (a file, a directory searched recursively, or a glob), sorted by URL, each with
    its size, listed through `fs` (else a filesystem made for it); a source that cannot be listed, or matches
    nothing, is refused with its URL and the reason."""
    where = f"data.sources[{index}]"
    fs = fs or source_filesystem(src, index)
    root = fs._strip_protocol(src.path)

    def listing() -> dict:
        if _GLOB_CHARS & set(root):
            return fs.glob(root, detail=True)
        # info, not isdir: fsspec's isdir answers False to any OSError, so a store down for a moment made a
        # directory look like a file.
        info = fs.info(root)
        return fs.find(root, detail=True) if info.get("type") == "directory" else {root: info}

    try:
        # A store that does not answer (restarting, a dropped connection) is asked again, as a fetch is.
        infos = retried(listing, f"listing {src.path}", _final, _patience(fs)[0])
    except FileNotFoundError:
        raise UserError(
            f"{where}.path {src.path} does not exist; give an existing file, directory or glob"
        ) from None
    except Exception as e:  # botocore, aiohttp and OSError each say why in one line
        tried = "" if _final(e) else f" ({_patience(fs)[1]})"
        raise UserError(
            f"{where}.path {src.path} cannot be listed{tried}: {type(e).__name__}: {e}{_endpoint_fix(src, where)}"
        ) from None
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    shards = sorted(
        Shard(fs.unstrip_protocol(p) if is_remote(src.path) else p, int(info.get("size") or 0), _tag(info))
        for p, info in infos.items()
        if info.get("type", "file") == "file"
    )
    if not shards:
        raise UserError(f"{where}.path {src.path} matches no files ({protocol}); point it at your shards")
    if all(s.size == 0 for s in shards):
        raise UserError(
            f"{where}.path {src.path} matches {len(shards)} file(s), all empty; point it at your data"
        )
    return shards


def _tag(info: dict) -> str:
    """The version of a listed file: S3's and GCS's ETag, else its modification time."""
    for key in ("ETag", "etag", "mtime", "LastModified", "updated"):
        if info.get(key):
            return str(info[key])
    return ""


class ShardCache:
    """Remote shards copied whole into `root`, at most `max_bytes` of them (least recently used first out; one in use
    stays readable through its link), fetched by a small thread pool ahead of use; local shards are read in place.
    Ranks on one node share `root`; each counts what it fetched and found there against max_bytes."""

    def __init__(
        self, root: Path, max_bytes: int, filesystems: list[fsspec.AbstractFileSystem], workers: int = 2
    ):
        self.root, self.max_bytes, self.filesystems = root, max_bytes, filesystems
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shard-fetch")
        self._pending: dict[str, Future] = {}
        self._lru: OrderedDict[str, int] = OrderedDict()  # local file name -> bytes, oldest first
        self._lock = threading.Lock()
        self.hits = self.fetched = 0
        root.mkdir(parents=True, exist_ok=True)
        for p in sorted(
            root.glob("*.shard"), key=lambda p: p.stat().st_mtime
        ):  # a warm cache from earlier runs
            self._lru[p.name] = p.stat().st_size

    def _name(self, shard: Shard) -> str:
        # The URL and size name the contents: a shard rewritten with another size is fetched anew.
        return hashlib.sha256(f"{shard.url}\0{shard.size}".encode()).hexdigest()[:32] + ".shard"

    def prefetch(self, source: int, shard: Shard) -> None:
        """Start fetching `shard` of data.sources[source] in the background, unless cached or under way."""
        if not is_remote(shard.url):
            return
        name = self._name(shard)
        with self._lock:
            if name in self._lru or name in self._pending:
                return
            self._pending[name] = self._pool.submit(self._fetch, source, shard, name)

    def open(self, source: int, shard: Shard) -> Path:
        """A local path of `shard`'s bytes, fetched now if it is not cached, valid until `release`: a hard link of
        the cached file, so another process evicting it from the shared cache cannot take it away mid-read."""
        if not is_remote(shard.url):
            return Path(shard.url.removeprefix("file://"))
        name = self._name(shard)
        pinned = self.root / f"{name}.use{os.getpid()}"
        for _ in range(2):  # evicted by another rank between its fetch and the link: fetched again, once
            with self._lock:
                self.hits += name in self._lru
            self.prefetch(source, shard)
            with self._lock:
                future = self._pending.get(name)
            if future is not None:
                future.result()  # raises the fetch's UserError
            with self._lock:
                self._pending.pop(name, None)
                if name in self._lru:
                    self._lru.move_to_end(name)
            try:
                pinned.unlink(missing_ok=True)
                os.link(self.root / name, pinned)
                return pinned
            except FileNotFoundError:
                with self._lock:
                    self._lru.pop(name, None)
        raise UserError(
            f"{shard.url}: its cached copy in {self.root} keeps disappearing; is another run evicting it?"
        )

    def release(self, shard: Shard) -> None:
        if is_remote(shard.url):
            (self.root / f"{self._name(shard)}.use{os.getpid()}").unlink(missing_ok=True)
            with self._lock:
                self._evict()

    def _fetch(self, source: int, shard: Shard, name: str) -> None:
        path = self.root / name
        if path.exists():  # fetched by another rank on this node
            with self._lock:
                self._lru[name] = path.stat().st_size
            return
        fs = self.filesystems[source]
        remote = fs._strip_protocol(shard.url)
        tmp = path.with_suffix(f".part{os.getpid()}.{threading.get_ident()}")

        def fetch() -> None:
            try:
                fs.get_file(remote, str(tmp))
                if tmp.stat().st_size != shard.size:  # a transfer cut short without an error
                    raise OSError(f"got {tmp.stat().st_size} of its {shard.size} bytes")
                os.replace(tmp, path)  # whole or not at all: a reader never sees a partial shard
            finally:
                tmp.unlink(missing_ok=True)

        try:
            # Every failure retried: a shard listed at launch is there.
            retried(fetch, f"reading {shard.url}", attempts=_patience(fs)[0])
        except Exception as e:
            raise UserError(
                f"data.sources[{source}]: {shard.url} cannot be read ({_patience(fs)[1]}): {type(e).__name__}: {e}"
            ) from None
        with self._lock:
            self.fetched += 1
            self._lru[name] = shard.size
            self._evict()

    def _evict(self) -> None:
        """Drop the least recently used shards not in use while the cache holds more than max_bytes (lock held)."""
        total = sum(self._lru.values())
        for name in list(self._lru):
            if total <= self.max_bytes:
                break
            if name in self._pending:
                continue
            (self.root / name).unlink(missing_ok=True)
            total -= self._lru.pop(name)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
