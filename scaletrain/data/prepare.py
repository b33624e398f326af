"""Tokenise each data source once into memory-mapped token shards under the cache directory; pre-tokenised
(.bin/.npy) sources are only indexed there and read in place.

A prepared directory is keyed by its files (paths, sizes, mtimes), format, field and tokenizer, so a later run with
the same inputs reuses it and a changed file is prepared again; it appears atomically (written aside, then renamed),
so a crash never leaves a half-written directory that looks complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scaletrain.config import DataConfig, SourceConfig
from scaletrain.data.sources import (
    CONVERT_HINT,
    Skipped,
    check_token_ids,
    embedded_corpus_files,
    list_files,
    read_documents,
    read_tokens,
    resolve_format,
)
from scaletrain.data.tokenizer import ByteTokenizer, HFTokenizer, fingerprint
from scaletrain.errors import UserError, unwritable
from scaletrain.hardware import usable_cpus

logger = logging.getLogger("scaletrain")

INDEX_VERSION = 1
# How files are read into documents, part of the cache key: revision 2 leaves out text that is not UTF-8 (revision 1
# replaced bad bytes with U+FFFD), so shards prepared by the old reader are not reused.
READER_REVISION = 2
# ~64M tokens: 128 MiB per uint16 shard, few enough files for large corpora and small enough to write in one go.
SHARD_TOKENS = 1 << 26
# HF documents are encoded in batches of this many: one Rust call per batch instead of one per document.
_ENCODE_BATCH = 256
# Bytes of a pre-tokenised file checked at a time while it is indexed: what the scan holds in memory, whatever the
# file's size (the file itself stays in the page cache, not in the process).
SCAN_BYTES = 1 << 25
# Part of the cache key of a pre-tokenised source: revision 1 copied its ids into shards, "inplace" indexes them.
_TOKENS_LAYOUT = "inplace"
PROGRESS_INTERVAL_S = 5.0  # at most one progress line per source this often (a 65 MB jsonl takes ~20 s)


@dataclass(frozen=True)
class TokenizeJob:
    """What a worker needs besides the file: inherited through fork, so it is never pickled."""

    tokenizer: ByteTokenizer | HFTokenizer
    fmt: str
    field: str
    index: int | None
    dtype: str
    src_dtype: str = ""  # format = "tokens": the dtype of raw .bin files (a .npy carries its own)


_JOB: TokenizeJob | None = None


def resolve_cache_dir(data_cfg: DataConfig) -> Path:
    """data.cache_dir, else $SCALETRAIN_CACHE, else ~/.cache/scaletrain."""
    raw = data_cfg.cache_dir or os.environ.get("SCALETRAIN_CACHE") or "~/.cache/scaletrain"
    return Path(raw).expanduser()


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 65535 else "uint32"


def cache_key(files: list[Path], fmt: str, field: str, tok_fingerprint: str) -> str:
    """sha256 of what determines the tokens: the files' identity (path, size, mtime), format, field, tokenizer."""
    h = hashlib.sha256()
    for p in sorted(files):
        st = p.stat()
        h.update(f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    h.update(f"{fmt}\0{field}\0{tok_fingerprint}\0reader{READER_REVISION}".encode())
    return h.hexdigest()[:16]


def tokenize_file(path: Path, job: TokenizeJob) -> tuple[np.ndarray, int, Skipped]:
    """All documents of one file as one token array, each document followed by eod; the document count; and what
    was left out as not UTF-8 text."""
    eod = np.array([job.tokenizer.eod_id], dtype=job.dtype)
    parts: list[np.ndarray] = []
    n_docs = 0
    skipped = Skipped()
    docs = read_documents(path, job.fmt, job.field, job.index, skipped)
    if isinstance(job.tokenizer, ByteTokenizer):
        for text in docs:
            # Fast path: the byte tokenizer's ids are the UTF-8 bytes themselves.
            parts += [np.frombuffer(text.encode("utf-8"), np.uint8), eod]
            n_docs += 1
    else:
        for batch in _batched(docs, _ENCODE_BATCH):
            for ids in job.tokenizer.encode_batch(batch):
                parts += [np.asarray(ids, dtype=job.dtype), eod]
            n_docs += len(batch)
    if not parts:
        return np.zeros(0, dtype=job.dtype), 0, skipped
    return np.concatenate(parts).astype(job.dtype, copy=False), n_docs, skipped


# What the tokenising generators yield: tokens, their document count, what was left out as not UTF-8 text, and the
# file these tokens complete (None while a file is only partly read).
_Chunk = tuple[np.ndarray, int, Skipped, Path | None]


def _index_token_files(
    files: list[Path], job: TokenizeJob, meter: _PrepareProgress
) -> tuple[list[dict], int]:
    """Pre-tokenised files as index entries that TokenShards memory-maps where they lie, never copied (a
    pre-training corpus is terabytes), and their document count. Each file is one stream as it is: no eod is added
    (their documents already end in the tokenizer's eod id, as nanoGPT's and Megatron's --append-eod files do).
    An entry records the file's size and mtime, so that a file changed since is refused, not read as indexed."""
    entries: list[dict] = []
    n_docs = 0
    for path in files:
        st = path.stat()  # before the scan: a file changed during it no longer matches its entry
        ids = read_tokens(
            path, job.src_dtype, job.index
        )  # checks the dtype and the shape; maps, reads nothing
        n, dtype, offset = len(ids), ids.dtype, int(getattr(ids, "offset", 0))  # .npy: after the header
        del ids
        n_docs += _scan_token_file(path, dtype, offset, n, job, meter)
        if n:  # np.memmap cannot map zero tokens
            entries.append(
                {"path": str(path.resolve()), "dtype": dtype.str, "offset": offset, "num_tokens": n,
                 "size": st.st_size, "mtime_ns": st.st_mtime_ns}
            )  # fmt: skip
        meter.update(0, path)
    return entries, n_docs


def _scan_token_file(
    path: Path, dtype: np.dtype, offset: int, n: int, job: TokenizeJob, meter: _PrepareProgress
) -> int:
    """Refuse ids outside the vocabulary (another tokenizer made them) before training, and count the eod ids:
    one pass through a SCAN_BYTES buffer, read with plain reads (not the map) so that the file does not become
    the process's resident memory."""
    step = max(1, SCAN_BYTES // dtype.itemsize)
    vocab, eod = job.tokenizer.vocab_size, job.tokenizer.eod_id
    docs = done = 0
    with open(path, "rb") as f:
        f.seek(offset)
        while done < n:
            chunk = np.fromfile(f, dtype=dtype, count=min(step, n - done))
            if chunk.size == 0:
                raise UserError(f"{path} ended after {done} of its {n} tokens: it changed while it was read")
            if int(chunk.max()) >= vocab or (dtype.kind == "i" and int(chunk.min()) < 0):
                check_token_ids(chunk, done, path, vocab)
            docs += int(np.count_nonzero(chunk == eod))
            done += chunk.size
            meter.update(chunk.size, None)
    return docs


def _batched(items: Iterator[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _init_worker(job: TokenizeJob) -> None:
    global _JOB
    _JOB = job
    # A forked worker inherits the trainer's SIGTERM handler (which only sets a preemption flag): restore the
    # default so that Pool.terminate() really stops it instead of waiting forever.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # Ctrl-C reaches the whole process group. A worker that raised KeyboardInterrupt while writing its result left
    # half a message in the pool's pipe, and Pool.terminate() then waited forever for the rest (1 time in 7): the
    # parent alone handles Ctrl-C, by terminating the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # forked while the parent held it back


def _tokenize_in_worker(task: tuple[Path, Path]) -> tuple[Path, int, Skipped]:
    """Tokenise a file into `part` (raw ids): the pool's pipe carries only a small message, so a worker stopped
    at any moment by Pool.terminate() leaves no partial message in it, and the tokens are not pickled."""
    assert _JOB is not None, "worker started without _init_worker"
    path, part = task
    tokens, n_docs, skipped = tokenize_file(path, _JOB)
    tokens.tofile(part)
    return part, n_docs, skipped


def _tokenized(files: list[Path], job: TokenizeJob, workers: int, part_dir: Path) -> Iterator[_Chunk]:
    """Token arrays in file order, whatever the worker count, so the shards are deterministic. Workers pass their
    tokens through files in `part_dir`, each read and deleted as it is consumed."""
    workers = min(workers, len(files))
    if workers <= 1:
        for p in files:
            yield *tokenize_file(p, job), p
        return
    # The Rust tokenizer's own thread pool must not run in forked children (it can deadlock).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    ctx = mp.get_context("fork")
    tasks = [(p, part_dir / f"part-{i:06d}.bin") for i, p in enumerate(files)]
    # Ctrl-C is held back while the workers are forked: one that lands in the parent's at-fork hooks is printed
    # as "Exception ignored" and lost (the preparation went on to the end). It is delivered after.
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(job,))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    # The context manager's exit terminates the workers whatever ends the loop (Ctrl-C, an error, close()).
    with pool:
        # imap (not imap_unordered) yields results in submission order; chunksize 1 balances uneven files.
        for (path, part), (_, n_docs, skipped) in zip(
            tasks, pool.imap(_tokenize_in_worker, tasks, chunksize=1), strict=True
        ):
            tokens = np.fromfile(part, dtype=job.dtype)
            part.unlink()
            yield tokens, n_docs, skipped, path
        pool.close()  # let idle workers exit on their own before the context manager's terminate()
        pool.join()


class _ShardWriter:
    """Appends token arrays to tokens-NNNNN.bin files of at most `shard_tokens` tokens each."""

    def __init__(self, out_dir: Path, dtype: str, shard_tokens: int):
        self.out_dir, self.dtype, self.shard_tokens = out_dir, dtype, shard_tokens
        self.shards: list[dict] = []
        self._f = None
        self._in_shard = 0

    def write(self, tokens: np.ndarray) -> None:
        while tokens.size:
            if self._f is None or self._in_shard == self.shard_tokens:
                self._open_next()
            take = min(tokens.size, self.shard_tokens - self._in_shard)
            self._f.write(tokens[:take].tobytes())
            self._in_shard += take
            self.shards[-1]["num_tokens"] += take
            tokens = tokens[take:]

    def _open_next(self) -> None:
        self.close()
        name = f"tokens-{len(self.shards):05d}.bin"
        self._f = open(self.out_dir / name, "wb")
        self._in_shard = 0
        self.shards.append({"file": name, "num_tokens": 0})

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Progress:
    """Calls `emit` with a line at most once per `interval_s` seconds (none in the first): a long job shows it
    is moving, a short one stays quiet."""

    def __init__(self, emit: Callable[[str], None], interval_s: float | None = None):
        self.emit = emit
        self.interval_s = PROGRESS_INTERVAL_S if interval_s is None else interval_s
        self.start = self.last = time.monotonic()

    def due(self) -> bool:
        """True (and the clock restarted) when a line is due."""
        now = time.monotonic()
        if now - self.last < self.interval_s:
            return False
        self.last = now
        return True

    def elapsed(self) -> float:
        return time.monotonic() - self.start


class _PrepareProgress:
    """`data: NAME: 3/12 files, 14.2/51.0 MB, 14,080,000 tokens, 5s`, through a Progress."""

    def __init__(self, name: str, files: list[Path], emit: Callable[[str], None]):
        self.name, self.n_files = name, len(files)
        self.sizes = {p: p.stat().st_size for p in files}
        self.total_mb = sum(self.sizes.values()) / 1e6
        self.files = self.tokens = 0
        self.mb = 0.0
        self.clock = Progress(emit)

    def update(self, tokens: int, done: Path | None) -> None:
        self.tokens += tokens
        if done is not None:
            self.files += 1
            self.mb += self.sizes.get(done, 0) / 1e6
        if self.clock.due():
            self.clock.emit(
                f"data: {self.name}: {self.files}/{self.n_files} files, {self.mb:.1f}/{self.total_mb:.1f} MB, "
                f"{self.tokens:,} tokens, {self.clock.elapsed():.0f}s"
            )


def _source_name(index: int | None) -> str:
    return f"data.sources[{index}]" if index is not None else "the embedded corpus"


def _check_skipped(skipped: Skipped, n_docs: int, n_files: int, index: int | None) -> None:
    """Warn about what was left out as not UTF-8 text; refuse a source that kept nothing (before anything of it is
    committed to the cache)."""
    if not skipped:
        return
    name = _source_name(index)
    if n_docs == 0:
        counts = f"all {n_files} file(s)" if skipped.files == n_files else skipped.counts()
        raise UserError(
            f"{name}: nothing to train on: {counts} are not UTF-8 text: {skipped.named()}; point {name}.path at "
            f"UTF-8 text, jsonl or parquet files, or {CONVERT_HINT}"
        )
    logger.warning("%s: left out %s; %s to keep them", name, skipped.describe(), CONVERT_HINT)


def _make_temp_dir(target: Path) -> Path:
    """A fresh temporary sibling of `target`; UserError naming the cache and how to move it when it cannot be
    written (a path under a regular file, no permission, a read-only file system)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    except OSError as e:
        why = unwritable(target.parent, e)
        raise UserError(
            f"cannot write prepared data into the cache {target.parent.parent} ({why}); set data.cache_dir or the "
            "SCALETRAIN_CACHE environment variable to a writable directory"
        ) from None


def _write_shards(
    tmp: Path, files: list[Path], job: TokenizeJob, workers: int, meter: _PrepareProgress
) -> tuple[list[dict], int, Skipped]:
    """Tokenise documents into tokens-NNNNN.bin shards in `tmp`: (shard entries, document count, left out)."""
    writer = _ShardWriter(tmp, job.dtype, SHARD_TOKENS)
    n_docs, skipped = 0, Skipped()
    parts = tmp / ".parts"  # the pool workers' output, each file deleted once it is in a shard
    parts.mkdir()
    chunks = _tokenized(files, job, workers, parts)
    # closing(): the pool stops here, not whenever the generator is collected, when the loop ends early
    # (Ctrl-C, an error in this loop).
    with contextlib.closing(chunks):
        for tokens, docs, left_out, done in chunks:
            writer.write(tokens)
            n_docs += docs
            skipped.update(left_out)
            meter.update(tokens.size, done)
    writer.close()
    parts.rmdir()
    _check_skipped(skipped, n_docs, len(files), job.index)
    return writer.shards, n_docs, skipped


def _write_prepared(
    target: Path,
    files: list[Path],
    job: TokenizeJob,
    workers: int,
    tok_fp: str,
    progress: Callable[[str], None],
) -> dict:
    """Tokenise (or, for token files, index) into a temporary sibling of `target`, then rename it into place;
    return the index."""
    tmp = _make_temp_dir(target)
    try:
        meter = _PrepareProgress(_source_name(job.index), files, progress)
        in_place = job.fmt == "tokens"
        if in_place:
            (shards, n_docs), skipped = _index_token_files(files, job, meter), Skipped()
        else:
            shards, n_docs, skipped = _write_shards(tmp, files, job, workers, meter)
        index = {
            "version": INDEX_VERSION,
            "dtype": job.dtype,
            "vocab_size": job.tokenizer.vocab_size,
            "eod_id": job.tokenizer.eod_id,
            "num_tokens": sum(s["num_tokens"] for s in shards),
            "num_documents": n_docs,
            "shards": shards,
            "in_place": in_place,
            "files": [str(p) for p in files],
            "tokenizer": tok_fp,
            "skipped": dataclasses.asdict(skipped),
        }
        (tmp / "index.json").write_text(json.dumps(index, indent=1))
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process renamed its copy first; its output is identical, so use it.
            if not (target / "index.json").is_file():
                raise
        return index
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prepare_source(
    files: list[Path],
    fmt: str,
    field: str,
    tokenizer: ByteTokenizer | HFTokenizer,
    cache_dir: Path,
    workers: int,
    index: int | None = None,
    src_dtype: str = "",
    progress: Callable[[str], None] | None = None,
) -> tuple[Path, dict, bool]:
    """Prepared directory for one source, its index, and whether it was a cache hit. `progress` gets a line every
    PROGRESS_INTERVAL_S while files are tokenised (default: stderr)."""
    if fmt == "auto" and all(resolve_format(p, fmt) == "tokens" for p in files):
        fmt = "tokens"  # .npy files: ids, not documents
    tok_fp = fingerprint(tokenizer)
    key_field = f"{field}\0dtype={src_dtype}" if src_dtype else field  # raw ids read as another dtype differ
    if fmt == "tokens":
        key_field += f"\0{_TOKENS_LAYOUT}"
    target = cache_dir / "shards" / cache_key(files, fmt, key_field, tok_fp)
    index_path = target / "index.json"
    if index_path.is_file():
        return target, json.loads(index_path.read_text()), True
    job = TokenizeJob(tokenizer, fmt, field, index, token_dtype(tokenizer.vocab_size), src_dtype)
    return target, _write_prepared(target, files, job, workers, tok_fp, progress or to_stderr), False


def prepare_data(
    data_cfg: DataConfig,
    tokenizer: ByteTokenizer | HFTokenizer,
    log: Callable[[str], None] = print,
    progress: Callable[[str], None] = to_stderr,
) -> list[tuple[Path, float]]:
    """Prepare every source (or the embedded corpus when none is given); return (prepared dir, weight) pairs.
    `log` gets one line per source; `progress` a line every PROGRESS_INTERVAL_S while a source is tokenised."""
    cache_dir = resolve_cache_dir(data_cfg)
    workers = data_cfg.workers or min(8, usable_cpus())
    if data_cfg.sources:
        sources = [(f"data.sources[{i}]", s, i) for i, s in enumerate(data_cfg.sources)]
    else:
        sources = [
            ("embedded corpus (stdlib .py files)", SourceConfig(path="", format="text", weight=1.0), None)
        ]
    out: list[tuple[Path, float]] = []
    for name, src, i in sources:
        files = list_files(src, i) if i is not None else embedded_corpus_files()
        t0 = time.perf_counter()
        target, index, hit = prepare_source(
            files, src.format, src.field, tokenizer, cache_dir, workers, i, src.dtype, progress
        )
        if hit:
            left_out = Skipped(**index.get("skipped", {}))
            note = f" ({left_out.counts()} that are not UTF-8 text were left out)" if left_out else ""
            where = f"indexed in {target}, read in place" if index.get("in_place") else f"in {target}"
            log(f"data: {name}: cache hit, {index['num_tokens']:,} tokens {where}{note}")
        elif index.get("in_place"):
            log(
                f"data: {name}: indexed {index['num_tokens']:,} tokens in {len(files)} token file(s), read in "
                f"place, {index['num_documents']:,} documents, in {time.perf_counter() - t0:.1f}s ({target})"
            )
        else:
            log(
                f"data: {name}: wrote {index['num_tokens']:,} tokens from {len(files)} file(s), "
                f"{index['num_documents']:,} documents, in {time.perf_counter() - t0:.1f}s to {target}"
            )
        out.append((target, float(src.weight)))
    return out
