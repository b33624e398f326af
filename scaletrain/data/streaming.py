"""data.streaming: training sequences read from the sources as training goes (local or object storage), tokenised
shard by shard, mixed by a schedule of tokens consumed; exactly once across resumes on any number of ranks.

Each source is one token stream per epoch: its shards in an order shuffled per epoch (seed, source, epoch), each
shard's documents in file order, an end-of-document id after each. The source's k-th sample is tokens
[k*L, k*L + L + 1) of that stream (L = data.seq_len), so a source is read once per epoch, never a document twice.
Sample g of the run comes from the source a smooth weighted round-robin picks with the schedule's weights at
g*L tokens: the realised shares follow the weights to within one sample. Every rank moves every source's position
over the whole global batch, by the token counts of the shards it passes (data/counts.py), and reads only the shards
under its own slice of the batch: a shard's count is taken by the ranks whose samples it is expected to hold (they
read it anyway) and shared over the control plane's gloo group, and kept on disk for later starts. The position is
therefore the same on every rank, and a checkpoint of it continues on any number of ranks, or under a schedule
changed for the steps not yet trained. Without a group (one process) every shard passed is read, in order.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from scaletrain.config import DataConfig, SourceConfig
from scaletrain.data.counts import INDEX_NAME, TokenCounts, group_gather, shard_key
from scaletrain.data.prepare import (
    READER_REVISION,
    TokenizeJob,
    resolve_cache_dir,
    token_dtype,
    tokenize_file,
)
from scaletrain.data.schedule import MixtureSchedule
from scaletrain.data.sources import Skipped, resolve_format
from scaletrain.data.storage import Shard, ShardCache, list_shards, source_filesystem
from scaletrain.data.tokenizer import ByteTokenizer, HFTokenizer, fingerprint
from scaletrain.errors import UserError

log = logging.getLogger("scaletrain")

# The fields of each source's position in the loader's state (and the checkpoint), as f"s{i}_{field}".
POSITION_FIELDS = ("epoch", "shard", "offset", "seed", "samples")
STREAM_FORMATS = ("auto", "text", "jsonl", "parquet")
# Tokens of read shards kept in memory a source (at least the two a window can span): a rank counts a few shards of
# a batch before it reads its samples from them.
TOKENS_KEPT = 1 << 25


class SourceDry(UserError):
    """A source (data.sources[index], called `name`) read to its end in its `epoch` (1-based) with data.when_dry =
    "stop": the run ends before the step that needed more of it. StreamingLoader.next_batch leaves its position
    where the batch began, so that a checkpoint of the step before holds the position after that step."""

    def __init__(self, message: str, index: int = -1, name: str = "", epoch: int = 0):
        super().__init__(message)
        self.index, self.name, self.epoch = index, name, epoch


def source_names(data: DataConfig) -> list[str]:
    return [s.name or f"source{i}" for i, s in enumerate(data.sources)] or ["the embedded corpus"]


def shuffle_seed(seed: int, source: int, epoch: int) -> int:
    """The seed of a source's shard order in an epoch: a new shuffle each epoch, its own per source."""
    return int(np.random.default_rng([seed % (1 << 63), 7, source, epoch]).integers(1 << 62))


def job_digest(job: TokenizeJob) -> str:
    """What makes a shard's tokens besides its bytes, for its token count's key: tokenizer, field, token dtype,
    reader revision (the format is the source's, or the URL's suffix under "auto": the URL is in the key)."""
    text = f"{fingerprint(job.tokenizer)}\0{job.fmt}\0{job.field}\0{job.dtype}\0reader{READER_REVISION}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class SourceStream:
    """One source's token stream and its position: epoch, the shard's place in the epoch's order, the token offset
    in that shard's tokens. The position moves by the shards' token counts (TokenCounts: agreed over the ranks, or
    counted here); a shard's tokens are read only for the samples kept. With `in_order` the shards of the epoch's
    order are fetched `read_ahead` ahead (ShardCache); else the loader says which ones this rank will read."""

    def __init__(self, index: int, shards: list[Shard], job: TokenizeJob, cache: ShardCache, seed: int,
                 read_ahead: int, stop_when_dry: bool, name: str, counts: TokenCounts,
                 in_order: bool = True):  # fmt: skip
        self.index, self.shards, self.job, self.cache = index, shards, job, cache
        self.seed, self.read_ahead, self.stop_when_dry, self.name = seed, read_ahead, stop_when_dry, name
        self.counts, self.in_order = counts, in_order
        digest = job_digest(job)
        self.keys = [shard_key(s, digest) for s in shards]
        self.epoch = self.shard = self.offset = self.samples = 0
        self._tokens: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()  # (epoch, shard) -> its tokens
        self._orders: dict[int, np.ndarray] = {}
        self._ratio = (-1, 1.0)  # (len(counts.agreed) when computed, tokens per byte of the agreed shards)
        self.skipped = Skipped()

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            rng = np.random.default_rng(shuffle_seed(self.seed, self.index, epoch))
            # Two epochs kept: the one being read and the next, whose first shards are fetched ahead.
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = rng.permutation(len(self.shards))
        return self._orders[epoch]

    def shard_at(self, epoch: int, k: int) -> Shard:
        return self.shards[int(self.order(epoch)[k])]

    def key_at(self, epoch: int, k: int) -> str:
        return self.keys[int(self.order(epoch)[k])]

    def has_tokens(self, epoch: int, k: int) -> bool:
        return (epoch, k) in self._tokens

    def tokens(self, epoch: int, k: int) -> np.ndarray:
        """The tokens of the k-th shard of `epoch`'s order (read, or fetched and read, once); its count recorded."""
        key = (epoch, k)
        if key not in self._tokens:
            shard = self.shard_at(epoch, k)
            # The next shards of the order, into the next epoch too (split reading: the loader says which).
            for ahead in range(1, self.read_ahead + 1 if self.in_order else 1):
                e, j = divmod(k + ahead, len(self.shards))
                self.cache.prefetch(self.index, self.shard_at(epoch + e, j))
            path = self.cache.open(self.index, shard)
            try:
                fmt = resolve_format(
                    Path(shard.url), self.job.fmt
                )  # by the URL's suffix: a cached file has none
                ids, _, skipped = tokenize_file(path, dataclasses.replace(self.job, fmt=fmt))
            finally:
                self.cache.release(shard)
            if skipped:
                log.warning("%s: left out %s", shard.url, skipped.describe())
                self.skipped.update(skipped)
            self.counts.record(self.key_at(epoch, k), len(ids))
            # The shard a window starts in and the one it ends in at least; more while they are small (a rank
            # counts a few shards of a batch before it reads its samples from them).
            held = sum(len(t) for t in self._tokens.values()) + len(ids)
            while len(self._tokens) > 1 and held > TOKENS_KEPT:
                held -= len(self._tokens.popitem(last=False)[1])
            self._tokens[key] = ids
        self._tokens.move_to_end(key)
        return self._tokens[key]

    def length(self, epoch: int, k: int) -> int:
        """The k-th shard's token count: agreed, else counted here (fetched and read)."""
        n = self.counts.get(self.key_at(epoch, k))
        return len(self.tokens(epoch, k)) if n is None else n

    def reach(self, end: int) -> Iterator[tuple[int, int, int, int, bool]]:
        """(epoch, k, start, stop, agreed) of each shard from the position on that tokens [0, end) after it fall
        in: start and stop relative to the position, estimated from the shard's size (the tokens per byte of the
        agreed shards) where the count is not agreed yet. Stops at the source's end with when_dry = "stop"."""
        epoch, k, pos, empty = self.epoch, self.shard, -self.offset, 0
        ratio = self._tokens_per_byte()
        while pos < end:
            n = self.counts.get(self.key_at(epoch, k))
            size = n if n is not None else max(1, round(self.shard_at(epoch, k).size * ratio))
            yield epoch, k, pos, pos + size, n is not None
            pos += size
            empty = empty + 1 if n == 0 else 0
            if empty > len(self.shards):
                raise UserError(f"{self.name}: none of its {len(self.shards)} shards gives a token (no documents "
                                "in the format and field given); check data.sources' format and field")  # fmt: skip
            k += 1
            if k == len(self.shards):
                if self.stop_when_dry:
                    return
                epoch, k = epoch + 1, 0

    def _tokens_per_byte(self) -> float:
        if self._ratio[0] != len(self.counts.agreed):
            known = [(n, s.size) for s, key in zip(self.shards, self.keys)
                     if (n := self.counts.get(key)) is not None]  # fmt: skip
            size = sum(b for _, b in known)
            self._ratio = (len(self.counts.agreed), sum(n for n, _ in known) / size if size else 1.0)
        return self._ratio[1]

    def _walk(self, n: int, keep: bool) -> tuple[list[np.ndarray], tuple[int, int, int]]:
        """The next `n` tokens from the position (when `keep`) and the position after them."""
        epoch, k, offset = self.epoch, self.shard, self.offset
        pieces, left = [], n
        while left:
            size = self.length(epoch, k)
            take = min(left, size - offset)
            if keep and take:
                pieces.append(self.tokens(epoch, k)[offset : offset + take])
            offset += take
            left -= take
            if offset == size:
                k, offset = k + 1, 0
                if k == len(self.shards):
                    if self.stop_when_dry and left:
                        raise SourceDry(
                            f"{self.name} has been read to its end (epoch {epoch + 1}); data.when_dry = 'stop' "
                            "ends the run here (set it to 'repeat' to read the source again in a new order)",
                            self.index, self.name, epoch + 1,
                        )  # fmt: skip
                    epoch, k = epoch + 1, 0
        return pieces, (epoch, k, offset)

    def next_sample(self, seq_len: int, keep: bool) -> np.ndarray | None:
        """The next sample (seq_len + 1 tokens, the last one the next sample's first) when `keep`; the position
        moves by seq_len tokens either way."""
        # Every rank walks seq_len + 1 tokens, kept or not: a source that runs dry does so on every rank at once.
        pieces, _ = self._walk(seq_len + 1, keep)
        out = np.concatenate(pieces).astype(np.int64) if keep else None
        _, (self.epoch, self.shard, self.offset) = self._walk(seq_len, False)
        self.samples += 1
        return out

    @functools.cached_property
    def listing(self) -> int:
        """A 62-bit digest of the shards' URLs and sizes: a position means nothing over another list of shards."""
        h = hashlib.sha256("".join(f"{s.url}\0{s.size}\n" for s in self.shards).encode())
        return int.from_bytes(h.digest()[:8], "little") >> 2

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "shard": self.shard, "offset": self.offset,
                "seed": shuffle_seed(self.seed, self.index, self.epoch), "samples": self.samples}  # fmt: skip

    def set_position(self, pos: dict[str, int]) -> None:
        self.epoch, self.shard, self.offset, self.samples = (
            int(pos[f]) for f in ("epoch", "shard", "offset", "samples")
        )


class StreamingLoader:
    """Global batch k is samples [k*B, (k+1)*B) of the mixed stream; rank r keeps the contiguous slice
    [r*B/dp, (r+1)*B/dp), as DataLoader does. Stateful: the sources' positions, the round-robin's credits and the
    next sample index, the same on every rank.

    With `counts` shared over a group of several ranks (split reading), a batch's shards are counted before it is
    read: each shard whose count no rank has is counted by the ranks whose samples it is expected to hold (by its
    size), the counts exchanged, and again until every source's walk over the batch is known; then each rank fetches
    and reads only the shards under its own samples."""

    def __init__(self, streams: list[SourceStream], schedule: MixtureSchedule, seq_len: int, global_batch: int,
                 dp_rank: int, dp_size: int, held_out: list[SourceStream],
                 counts: TokenCounts | None = None):  # fmt: skip
        if global_batch <= 0 or global_batch % dp_size:
            raise UserError(f"training.global_batch={global_batch} must be a positive multiple of the "
                            f"data-parallel size {dp_size}")  # fmt: skip
        self.streams, self.schedule, self.seq_len = streams, schedule, seq_len
        self.global_batch, self.dp_rank, self.dp_size = global_batch, dp_rank, dp_size
        self.held_out = held_out
        split = counts is not None and counts.gather is not None and dp_size > 1
        self.token_counts = counts if split else None
        self.next_sample = 0
        self.credits = np.zeros(len(streams))
        self._counts = np.zeros(len(streams), dtype=np.int64)  # samples per source since shares() was read
        self._val: list[np.ndarray] | None = None

    def _pick(self, g: int) -> int:
        """The source of sample g: smooth weighted round-robin (nginx's), so each source's share of any run of
        samples is its weight's to within one sample, without randomness to average out."""
        w = self.schedule.weights(g * self.seq_len)
        self.credits += w
        # Only sources with a weight now: one weighted down to 0 may keep a credit from before.
        i = int(np.argmax(np.where(w > 0, self.credits, -np.inf)))
        self.credits[i] -= 1.0
        return i

    def next_batch(self, sequences: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.global_batch if sequences is None else sequences
        if n <= 0 or n % self.dp_size:
            raise ValueError(f"a step's batch of {n} sequences does not split over {self.dp_size} ranks")
        local = n // self.dp_size
        before, counts = self.state_dict(), self._counts.copy()
        picks = [self._pick(self.next_sample + j) for j in range(n)]
        for i in picks:
            self._counts[i] += 1
        try:
            samples = self._read(picks, range(self.dp_rank * local, (self.dp_rank + 1) * local))
        except SourceDry:
            # The whole batch or none of it: every rank finds the source dry at the same sample (each walks the
            # whole batch), none trains a part of a step, and the position stays after the last whole batch.
            self.load_state_dict(before)
            self._counts[:] = counts
            raise
        self.next_sample += n
        return _to_batch(samples)

    def _read(self, picks: list[int], mine: range) -> list[np.ndarray]:
        """Move every source over the samples `picks` names (sample j from source picks[j]); the samples in
        `mine`, read."""
        by_source: dict[int, list[int]] = {}
        for j, i in enumerate(picks):
            by_source.setdefault(i, []).append(j)
        if self.token_counts is not None:
            self._agree(by_source, len(picks))
            self._fetch_mine(by_source, mine, 0)
        samples = []
        for j, i in enumerate(picks):
            sample = self.streams[i].next_sample(self.seq_len, keep=j in mine)
            if sample is not None:
                samples.append(sample)
        if self.token_counts is not None and self.streams[0].read_ahead:  # where its next samples will lie
            self._fetch_mine(by_source, mine, self.streams[0].read_ahead)
        return samples

    def _agree(self, by_source: dict[int, list[int]], n: int) -> None:
        """Count, over the ranks, every shard the batch's walk passes (a collective: every rank of the group calls it
        at the same point, and decides from the agreed counts alone whether to go round again)."""
        # A rollback's gap of samples (load_state_dict) need not split evenly: owners are a guess either way.
        c, L, local = self.token_counts, self.seq_len, max(1, n // self.dp_size)
        assert c is not None
        if c.members is None:  # first use: each rank's slice, and what each found on disk or read at build
            c.share(self.dp_rank)
        while True:
            todo, unknown = [], False
            for i, js in by_source.items():
                s, m = self.streams[i], len(js)
                # An eighth more than the walk: a shard whose size put it just past the walk's end is counted in
                # this round, not alone in another (it is the next batch's if not this one's).
                for e, k, a, b, agreed in s.reach(m * L + 1 + m * L // 8):
                    if agreed:
                        continue
                    unknown |= a < m * L + 1
                    # Sample t of this source holds its tokens [t*L, t*L + L + 1): those over [a, b) are expected to
                    # need the shard (past the batch: the next one's, taken as like this one); their ranks count it
                    # (they read it anyway), or one member if none is in this group.
                    lo = max(0, (a - 1) // L)
                    ts = range(lo, min((b - 1) // L, lo + m - 1) + 1)  # m of them name every rank there is
                    owners = {js[t % m] // local for t in ts} & set(c.members)
                    anyone = (e * len(s.shards) + k) % len(c.members) == c.group_rank
                    if (self.dp_rank in owners) if owners else anyone:
                        todo.append((s, e, k))
            if not unknown:
                return
            for s, e, k in todo:
                if not s.has_tokens(e, k):
                    s.cache.prefetch(s.index, s.shard_at(e, k))
            for s, e, k in todo:
                if s.key_at(e, k) not in c.pending:
                    s.tokens(e, k)
            c.share(self.dp_rank)

    def _fetch_mine(self, by_source: dict[int, list[int]], mine: range, ahead: int) -> None:
        """Start fetching the shards under this rank's samples of the batch (ahead = 0), or, after it, up to `ahead`
        shards a source where its samples of a batch as large would lie from the new position."""
        L = self.seq_len
        for i, js in by_source.items():
            ts = [t for t, j in enumerate(js) if j in mine]
            if not ts:
                continue
            s, a, b, started = self.streams[i], ts[0] * L, ts[-1] * L + L + 1, 0
            for e, k, _, stop, _ in s.reach(b):
                if stop > a and not s.has_tokens(e, k):
                    s.cache.prefetch(s.index, s.shard_at(e, k))
                    started += 1
                    if ahead and started >= ahead:
                        break

    def shares(self) -> dict[str, float]:
        """Each source's share of the samples since the last call (metrics: data_share/NAME)."""
        total = max(1, int(self._counts.sum()))
        out = {f"data_share/{s.name}": round(int(c) / total, 6) for s, c in zip(self.streams, self._counts)}
        self._counts[:] = 0
        return out

    def val_batches(self, n_sequences: int, micro_batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share of the first n_sequences held-out windows (each source's held-out shard in turn)."""
        if self._val is None:
            self._val = []
            for s in self.held_out:
                ids = s.tokens(0, 0)
                self._val += [ids[j : j + self.seq_len + 1].astype(np.int64)
                              for j in range(0, len(ids) - self.seq_len, self.seq_len)]  # fmt: skip
        n = min(n_sequences, len(self._val))
        n -= n % self.dp_size
        if n == 0:
            raise UserError(f"the held-out shards give {len(self._val)} validation sequences, fewer than the "
                            f"{self.dp_size} data-parallel ranks; set training.eval_interval = 0")  # fmt: skip
        share = n // self.dp_size
        first = self.dp_rank * share
        for start in range(first, first + share, micro_batch):
            yield _to_batch(self._val[start : min(start + micro_batch, first + share)])

    def state_dict(self) -> dict[str, int | float]:
        sd: dict[str, int | float] = {"next_sample": self.next_sample, "global_batch": self.global_batch}
        for i, s in enumerate(self.streams):
            sd.update({f"s{i}_{k}": v for k, v in s.position().items()})
            sd[f"s{i}_credit"] = float(self.credits[i])
            sd[f"s{i}_listing"] = s.listing
        return sd

    def load_state_dict(self, sd: dict[str, int | float]) -> None:
        for i, s in enumerate(self.streams):
            if f"s{i}_listing" in sd and int(sd[f"s{i}_listing"]) != s.listing:
                raise UserError(
                    f"{s.name}'s shards changed since this position was saved (files added, removed or rewritten "
                    "under its path): the saved position cannot be continued exactly; restore the files, or start a "
                    "new run"
                )
            s.set_position({k: sd[f"s{i}_{k}"] for k in POSITION_FIELDS})
            self.credits[i] = float(sd[f"s{i}_credit"])
        self.next_sample = sum(s.samples for s in self.streams)
        # A rollback past bad batches (resilience.guard) asks for a later sample than the position it restored:
        # the samples in between are passed over, so every source still moves on by what they held.
        target = int(sd["next_sample"])
        if self.next_sample < target:
            self._read([self._pick(g) for g in range(self.next_sample, target)], range(0))
            self.next_sample = target

    def close(self) -> None:
        self.streams[0].cache.close()


def _to_batch(samples: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.from_numpy(np.stack(samples))
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def stream_source_problems(src: SourceConfig, index: int) -> list[str]:
    """What keeps a source from streaming, found before launch: a format it cannot stream, or a URL that cannot be
    listed (with the reason), or matches nothing."""
    if src.format not in STREAM_FORMATS:
        return [f"data.sources[{index}].format {src.format} cannot be streamed; use one of {', '.join(STREAM_FORMATS)}, "
                "or set data.streaming = false to read it as prepared shards"]  # fmt: skip
    try:
        list_shards(src, index)
    except UserError as e:
        return [str(e)]
    return []


def build_streaming_loader(data: DataConfig, tokenizer: ByteTokenizer | HFTokenizer, global_batch: int,
                           dp_rank: int, dp_size: int, seed: int, run_tokens: int,
                           log_fn: Callable[[str], None] = log.info,
                           group: dist.ProcessGroup | None = None) -> StreamingLoader:  # fmt: skip
    """The streaming loader of data.sources, each listed and its first shard read before step 1 (a source that
    cannot be is refused here, with its URL and the reason). With `group` (the control plane's gloo group, over
    ranks of several data-parallel slices) the ranks split the reading: each fetches only the shards under its
    samples, and the first shard is read by data-parallel rank 0 alone."""
    if not data.sources:
        raise UserError("data.streaming reads data.sources; add at least one source (a path or an s3:// URL)")
    # One filesystem per source, for its listing and its fetches (a new S3 client costs about a second).
    filesystems = [source_filesystem(s, i) for i, s in enumerate(data.sources)]
    cache = ShardCache(resolve_cache_dir(data) / "stream", data.stream_cache_mb << 20, filesystems)
    split = group is not None and dp_size > 1 and dist.get_world_size(group) > 1
    gather, group_rank = group_gather(group) if split else (None, dp_rank)
    counts = TokenCounts(resolve_cache_dir(data) / INDEX_NAME, gather, group_rank)
    names = source_names(data)
    streams, held_out = [], []
    for i, src in enumerate(data.sources):
        shards = list_shards(src, i, filesystems[i])
        job = TokenizeJob(tokenizer, src.format, src.field, i, token_dtype(tokenizer.vocab_size))
        if data.val_fraction > 0:
            if len(shards) < 2:
                raise UserError(f"{names[i]} ({src.path}) has one shard; streaming holds out each source's last "
                                "shard for validation: give it more shards, or set data.val_fraction = 0")  # fmt: skip
            held_out.append(SourceStream(i, shards[-1:], job, cache, seed, 0, True, names[i], counts))
            shards = shards[:-1]
        stream = SourceStream(i, shards, job, cache, seed, data.read_ahead, data.when_dry == "stop", names[i],
                              counts, in_order=not split)  # fmt: skip
        streams.append(stream)
        # The first shard of the first epoch, read now: a source that cannot be read fails here.
        if not split or dp_rank == 0:
            stream.tokens(0, 0)
        log_fn(
            f"{names[i]}: {len(shards)} shard(s), {sum(s.size for s in shards) / 2**20:,.1f} MiB at {src.path}"
        )
    schedule = MixtureSchedule.of(data, run_tokens)
    return StreamingLoader(streams, schedule, data.seq_len, global_batch, dp_rank, dp_size, held_out, counts)


def describe_position(data: DataConfig, state: dict[str, int | float]) -> list[dict]:
    """Each source's saved position (a loader's state_dict) as a user reads it: what was trained from it and what
    is left of its current epoch. Lists the sources again, for the shards' names and sizes."""
    out = []
    for i, (src, name) in enumerate(zip(data.sources, source_names(data))):
        shards = list_shards(src, i)[: -1 if data.val_fraction > 0 else None]  # the last one held out
        pos = {k: int(state[f"s{i}_{k}"]) for k in POSITION_FIELDS}
        order = np.random.default_rng(pos["seed"]).permutation(len(shards))
        left = [shards[j] for j in order[pos["shard"] :]]  # the current shard, then those not started
        out.append({
            "source": name, "path": src.path, "epoch": pos["epoch"] + 1, "shard": pos["shard"] + 1,
            "shards": len(shards), "current": left[0].url, "token_offset": pos["offset"], "seed": pos["seed"],
            "samples": pos["samples"], "tokens_trained": pos["samples"] * data.seq_len,
            "shards_left": len(left) - 1, "mib_left": round(sum(s.size for s in left[1:]) / 2**20, 3),
        })  # fmt: skip
    return out
