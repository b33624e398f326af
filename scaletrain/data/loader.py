"""Packed training sequences from prepared token shards: a weighted, seeded mixture over sources and a resumable,
data-parallel batch loader whose global batches do not depend on the number of ranks; and the checks of data.*
before launch (data_problems).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from scaletrain.config import DataConfig
from scaletrain.data.prepare import prepare_data
from scaletrain.data.sources import list_files
from scaletrain.data.streaming import StreamingLoader, build_streaming_loader, stream_source_problems
from scaletrain.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from scaletrain.errors import UserError


@dataclass(frozen=True)
class _TokenFile:
    """`num_tokens` ids of `dtype` stored from byte `offset` of `path` (a .npy's ids start after its header)."""

    path: Path
    dtype: np.dtype
    offset: int
    num_tokens: int

    def read(self, start: int, count: int) -> np.ndarray:
        # A positioned read, not a memory map: a window of a mapped file faults in whole 2 MiB folios (file THP),
        # so random windows made the mapped file the process's resident memory (217 MiB after 320 windows of a
        # 200 MiB file, measured; nanoGPT re-creates its np.memmap per batch for the same reason). The page cache
        # still caches the file; ~20 us per window.
        ids = np.fromfile(
            self.path, dtype=self.dtype, count=count, offset=self.offset + start * self.dtype.itemsize
        )
        if ids.size != count:
            raise UserError(
                f"{self.path} ended before its {self.num_tokens:,} indexed tokens; prepare the data again"
            )
        return ids


class TokenShards:
    """One prepared source as a single token stream over files read where they lie: the shards prepare-data wrote,
    or a pre-tokenised source's own .bin/.npy files. Only the windows asked for are read."""

    def __init__(self, prepared_dir: str | Path):
        self.dir = Path(prepared_dir)
        self.index = json.loads((self.dir / "index.json").read_text())
        self._shards = [self._file(s) for s in self.index["shards"] if s["num_tokens"] > 0]
        sizes = [s.num_tokens for s in self._shards]
        # _starts[k] is the stream position of shard k's first token; the last entry is the total.
        self._starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        self.num_tokens = int(self._starts[-1])
        self.eod_id: int = self.index["eod_id"]
        self.vocab_size: int = self.index["vocab_size"]

    def _file(self, shard: dict) -> _TokenFile:
        n = shard["num_tokens"]
        if "path" not in shard:  # a shard prepare-data wrote
            return _TokenFile(self.dir / shard["file"], np.dtype(self.index["dtype"]), 0, n)
        path = Path(shard["path"])  # a token file, read in place
        try:
            st = path.stat()
        except OSError as e:
            raise UserError(
                f"{path}, indexed in {self.dir}, cannot be read ({e.strerror}); restore it"
            ) from None
        if (st.st_size, st.st_mtime_ns) != (shard["size"], shard["mtime_ns"]):
            # Its index (and the vocabulary check) describe the old contents; the new ones have another cache key.
            raise UserError(
                f"{path} changed (size or modification time) since it was indexed in {self.dir}; prepare the data "
                "again (`scaletrain prepare-data`, or start the run again): a changed file is indexed anew"
            )
        return _TokenFile(path, np.dtype(shard["dtype"]), shard["offset"], n)

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream, as int64 (may span shard boundaries)."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"window [{start}, {start + length}) outside 0..{self.num_tokens}")
        out = np.empty(length, dtype=np.int64)
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        done = 0
        while done < length:
            offset = start + done - int(self._starts[k])
            take = min(length - done, self._shards[k].num_tokens - offset)
            out[done : done + take] = self._shards[k].read(offset, take)
            done += take
            k += 1
        return out


def split_windows(num_tokens: int, seq_len: int, val_fraction: float) -> tuple[int, int]:
    """(training, validation) window counts of a source; validation windows are the last ones."""
    n = max(0, (num_tokens - 1) // seq_len)
    n_val = max(1, round(n * val_fraction)) if val_fraction > 0 and n > 0 else 0
    return n - n_val, n_val


class Mixture:
    """Training samples drawn from several sources in proportion to their weights, as a pure function of
    (seed, global sample index); plus the fixed list of validation windows.

    An epoch is N = (all training windows) samples; source i gets round(w_i / sum(w) * N) of them, repeated or
    subsampled by a seeded permutation, and the epoch's (source, window) list is then shuffled.
    """

    def __init__(
        self,
        sources: list[tuple[TokenShards, float]],
        seq_len: int,
        val_fraction: float,
        seed: int,
        names: list[str] | None = None,
    ):
        if not sources:
            raise UserError(
                "no data sources; add entries to data.sources or leave it empty for the default corpus"
            )
        self.shards = [s for s, _ in sources]
        self.weights = np.array([w for _, w in sources], dtype=np.float64)
        self.seq_len, self.seed = seq_len, seed
        self.names = names or [f"source {i} ({s.dir})" for i, s in enumerate(self.shards)]
        if (self.weights < 0).any() or self.weights.sum() <= 0:
            raise UserError(f"data.sources weights {self.weights.tolist()} must be >= 0 with a positive sum")
        splits = [split_windows(s.num_tokens, seq_len, val_fraction) for s in self.shards]
        self.n_train = np.array([t for t, _ in splits], dtype=np.int64)
        self.n_val = np.array([v for _, v in splits], dtype=np.int64)
        total = int(self.n_train.sum())
        self.n_per_epoch = np.rint(self.weights / self.weights.sum() * total).astype(np.int64)
        self._check(val_fraction)
        self.epoch_len = int(self.n_per_epoch.sum())
        self._val_starts = np.concatenate([[0], np.cumsum(self.n_val)]).astype(np.int64)
        self._epoch: tuple[int, np.ndarray, np.ndarray] | None = None

    @property
    def num_train_windows(self) -> int:
        return int(self.n_train.sum())

    @property
    def num_val_windows(self) -> int:
        return int(self.n_val.sum())

    def _check(self, val_fraction: float) -> None:
        tokens = sum(s.num_tokens for s in self.shards)
        need = f"at least {self.seq_len + 1} tokens per source"
        if val_fraction > 0:
            need = f"at least {2 * self.seq_len + 1} tokens per source (one training and one validation sequence)"
        if self.num_train_windows == 0:
            raise UserError(
                f"the data has {tokens:,} tokens, which give no training sequence of data.seq_len={self.seq_len} "
                f"tokens (data.val_fraction={val_fraction}); need {need}: add data or lower data.seq_len"
            )
        if val_fraction > 0 and self.num_val_windows == 0:
            raise UserError(
                f"the data has {tokens:,} tokens, which give no validation sequence of data.seq_len={self.seq_len}; "
                "add data, lower data.seq_len, or set data.val_fraction = 0"
            )
        if self.n_per_epoch.sum() == 0:
            raise UserError(
                f"the data gives {self.num_train_windows} training sequence(s) of data.seq_len={self.seq_len} "
                f"tokens, too few to split by the weights {self.weights.tolist()}; add data or lower data.seq_len"
            )
        for i, (name, s) in enumerate(zip(self.names, self.shards, strict=True)):
            if self.n_per_epoch[i] > 0 and self.n_train[i] == 0:
                raise UserError(
                    f"{name} has {s.num_tokens:,} tokens, which give no training sequence of data.seq_len="
                    f"{self.seq_len} tokens; need {need}: add data to it, set its weight to 0, or lower data.seq_len"
                )

    def _rng(self, *tags: int) -> np.random.Generator:
        # SeedSequence takes non-negative entropy words; the tags keep the streams of each use apart.
        return np.random.default_rng([self.seed % (1 << 63), *tags])

    def _build_epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        src_parts, win_parts = [], []
        for i, (n_train, n_take) in enumerate(zip(self.n_train, self.n_per_epoch, strict=True)):
            if n_take == 0:
                continue
            rng = self._rng(epoch, 1, i)
            # Whole permutations back to back: each window is used floor or ceil(n_take / n_train) times.
            reps = -(-int(n_take) // int(n_train))
            wins = np.concatenate([rng.permutation(int(n_train)) for _ in range(reps)])[:n_take]
            src_parts.append(np.full(n_take, i, dtype=np.int32))
            win_parts.append(wins.astype(np.int64))
        order = self._rng(epoch, 0).permutation(self.epoch_len)
        return np.concatenate(src_parts)[order], np.concatenate(win_parts)[order]

    def sample(self, g: int) -> np.ndarray:
        """Training sample number g (any g >= 0): seq_len + 1 int64 tokens, inputs then shifted targets."""
        epoch, pos = divmod(int(g), self.epoch_len)
        if self._epoch is None or self._epoch[0] != epoch:
            # Only the current epoch is kept: sequential reads rebuild it once per epoch.
            self._epoch = (epoch, *self._build_epoch(epoch))
        _, src, win = self._epoch
        return self.shards[src[pos]].window(int(win[pos]) * self.seq_len, self.seq_len + 1)

    def val_sample(self, j: int) -> np.ndarray:
        """Validation window j: the sources' held-out windows concatenated in source order."""
        if not 0 <= j < self.num_val_windows:
            raise IndexError(f"validation window {j} outside 0..{self.num_val_windows}")
        i = int(np.searchsorted(self._val_starts, j, side="right")) - 1
        win = int(self.n_train[i]) + j - int(self._val_starts[i])
        return self.shards[i].window(win * self.seq_len, self.seq_len + 1)


def _to_batch(samples: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.from_numpy(np.stack(samples))
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


class DataLoader:
    """Global batch k is mixture samples [k*B, (k+1)*B); rank r takes the contiguous slice
    [r*B/dp, (r+1)*B/dp), so the ranks' batches concatenated equal the single-rank batch. Stateful."""

    def __init__(self, mixture: Mixture, global_batch: int, dp_rank: int, dp_size: int):
        if global_batch <= 0 or global_batch % dp_size != 0:
            raise UserError(
                f"training.global_batch={global_batch} must be a positive multiple of the data-parallel size "
                f"{dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside 0..{dp_size}")
        self.mixture = mixture
        self.global_batch, self.dp_rank, self.dp_size = global_batch, dp_rank, dp_size
        self.local_batch = global_batch // dp_size
        self.next_sample = 0

    def next_batch(self, sequences: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each int64 [sequences // dp_size, seq_len]; advances by `sequences` (default: one
        global batch). A batch ramp's smaller steps take the next samples of the same global stream, so the stream
        is read in order, once, whatever the batch of each step and the number of ranks."""
        n = self.global_batch if sequences is None else sequences
        if n <= 0 or n % self.dp_size:
            raise ValueError(f"a step's batch of {n} sequences does not split over {self.dp_size} ranks")
        local = n // self.dp_size
        first = self.next_sample + self.dp_rank * local
        batch = _to_batch([self.mixture.sample(g) for g in range(first, first + local)])
        self.next_sample += n
        return batch

    def val_batches(self, n_sequences: int, micro_batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share of the first n_sequences validation windows, in micro-batches."""
        n = min(n_sequences, self.mixture.num_val_windows)
        n -= n % self.dp_size
        if n == 0:
            raise UserError(
                f"the data gives {self.mixture.num_val_windows} validation sequences, fewer than the "
                f"{self.dp_size} data-parallel ranks; raise data.val_fraction or training.eval_sequences, "
                "or set training.eval_interval = 0"
            )
        share = n // self.dp_size
        first = self.dp_rank * share
        for start in range(first, first + share, micro_batch):
            stop = min(start + micro_batch, first + share)
            yield _to_batch([self.mixture.val_sample(j) for j in range(start, stop)])

    def shares(self) -> dict[str, float]:
        """The sources' realised shares for the metrics: none here, the fixed weights say them (data.streaming
        logs its scheduled mixture's)."""
        return {}

    def state_dict(self) -> dict[str, int]:
        return {"next_sample": self.next_sample, "global_batch": self.global_batch}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        # Positions are global sample indices, so resuming with another global batch or rank count is exact.
        self.next_sample = int(sd["next_sample"])


def build_loader(
    data_cfg: DataConfig,
    tokenizer: ByteTokenizer | HFTokenizer,
    global_batch: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    log: Callable[[str], None] = print,
    run_tokens: int = 0,
    group: dist.ProcessGroup | None = None,
) -> DataLoader | StreamingLoader:
    """Prepare (or reuse) the token shards, mix the sources and return this rank's loader; with data.streaming,
    the streaming loader (its schedule's shares of the run are of `run_tokens`, what training.steps consume; the
    ranks of `group`, the control plane's, split the reading of the shards)."""
    if data_cfg.streaming:
        return build_streaming_loader(
            data_cfg, tokenizer, global_batch, dp_rank, dp_size, seed, run_tokens, log, group
        )
    prepared = prepare_data(data_cfg, tokenizer, log)
    names = (
        [f"data.sources[{i}]" for i in range(len(prepared))] if data_cfg.sources else ["the embedded corpus"]
    )
    mixture = Mixture(
        [(TokenShards(d), w) for d, w in prepared], data_cfg.seq_len, data_cfg.val_fraction, seed, names
    )
    if mixture.num_train_windows < global_batch:
        raise UserError(
            f"the data gives {mixture.num_train_windows} training sequences of {data_cfg.seq_len} tokens, fewer "
            f"than one global batch of {global_batch}; add data, or lower training.global_batch / data.seq_len"
        )
    if data_cfg.val_fraction > 0 and mixture.num_val_windows < dp_size:
        # Checked here, not at the first evaluation, so the run fails before any work is done.
        raise UserError(
            f"the data gives {mixture.num_val_windows} validation sequence(s), fewer than the {dp_size} "
            "data-parallel ranks; add data, raise data.val_fraction, or set data.val_fraction = 0"
        )
    return DataLoader(mixture, global_batch, dp_rank, dp_size)


def tokenizer_vocab(spec: str) -> int | None:
    """The tokenizer's vocabulary, or None when it does not load (data_problems reports why)."""
    try:
        return load_tokenizer(spec).vocab_size
    except UserError:
        return None


def data_problems(d: DataConfig) -> list[str]:
    problems = []
    if d.seq_len < 2:
        problems.append(f"data.seq_len must be >= 2, got {d.seq_len}")
    if not 0 <= d.val_fraction < 1:
        problems.append(f"data.val_fraction must be in [0, 1), got {d.val_fraction}")
    if d.workers < 0:
        problems.append("data.workers must be >= 0 (0 = one per core)")
    for i, src in enumerate(d.sources):
        # A streamed source may start at weight 0 and get a share from a data.schedule stage.
        if src.weight < 0 or (src.weight == 0 and not d.streaming):
            problems.append(f"data.sources[{i}].weight must be > 0, got {src.weight}")
        if not src.path:
            problems.append(f"data.sources[{i}].path is empty; give a file, a directory or a glob")
            continue
        if d.streaming:
            problems += stream_source_problems(src, i)
            continue
        if "://" in src.path and not src.path.startswith("file://"):
            problems.append(
                f"data.sources[{i}].path {src.path} is a URL: set data.streaming = true to read it shard by shard "
                "(prepare-data reads local files)"
            )
            continue
        try:
            list_files(src, i)
        except UserError as e:
            problems.append(str(e))
    try:
        load_tokenizer(d.tokenizer)
    except UserError as e:
        problems.append(str(e))
    return problems
