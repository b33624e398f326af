"""Pre-tokenised .bin/.npy files read in place (issue 23 item 5): the cache holds an index, not a copy; the batches
are those the copied shards gave; opening does not make the file resident; a changed file is indexed anew."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from scaletrain.config import DataConfig, SourceConfig
from scaletrain.data.loader import DataLoader, Mixture, TokenShards, build_loader
from scaletrain.data.prepare import prepare_data
from scaletrain.data.tokenizer import ByteTokenizer
from scaletrain.errors import UserError

EOD = ByteTokenizer.eod_id
QUIET = lambda s: None  # noqa: E731


def _ids(n: int, seed: int = 0) -> np.ndarray:
    """Byte-tokenizer ids with an eod about every 50 tokens."""
    ids = np.random.default_rng(seed).integers(0, 256, n, dtype=np.int64)
    ids[::50] = EOD
    return ids


def _prepare(src: SourceConfig, cache: Path) -> Path:
    ((prepared, _),) = prepare_data(
        DataConfig(sources=[src], cache_dir=str(cache)), ByteTokenizer(), log=QUIET
    )
    return prepared


def _copied_shards(ids: np.ndarray, where: Path) -> TokenShards:
    """What the old preparation wrote for these ids: one uint16 tokens-00000.bin and its index, in the cache."""
    where.mkdir()
    ids.astype(np.uint16).tofile(where / "tokens-00000.bin")
    shard = {"file": "tokens-00000.bin", "num_tokens": len(ids)}
    index = {"version": 1, "dtype": "uint16", "vocab_size": 257, "eod_id": EOD, "shards": [shard]}
    (where / "index.json").write_text(json.dumps(index))
    return TokenShards(where)


def _cache_bytes(cache: Path) -> int:
    return sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())


def test_token_files_in_place_give_the_batches_of_copied_shards_and_the_cache_holds_no_copy(tmp_path):
    ids = _ids(40_000)
    raw, npy = tmp_path / "raw", tmp_path / "npy"
    raw.mkdir(), npy.mkdir()
    # Two sources, four files, three layouts: raw uint32 .bin files; a big-endian and an int64 .npy (the header
    # skipped, the dtype read from it).
    ids[:10_000].astype(np.uint32).tofile(raw / "a.bin")
    ids[10_000:20_000].astype(np.uint32).tofile(raw / "b.bin")
    np.save(npy / "c.npy", ids[20_000:35_000].astype(">u2"))
    np.save(npy / "d.npy", ids[35_000:])
    cfg = DataConfig(
        sources=[
            SourceConfig(path=str(raw), format="tokens", dtype="uint32", weight=2.0),
            SourceConfig(path=str(npy / "*.npy"), weight=1.0),
        ],
        cache_dir=str(tmp_path / "cache"),
        seq_len=64,
        val_fraction=0.05,
    )
    loader = build_loader(cfg, ByteTokenizer(), 8, 0, 1, seed=3, log=QUIET)
    # The cache holds the indexes only: a few hundred bytes, not the 240 KB of ids.
    assert _cache_bytes(tmp_path / "cache") < 4096
    streams = loader.mixture.shards
    assert [s.window(0, s.num_tokens).tolist() for s in streams] == [
        ids[:20_000].tolist(),
        ids[20_000:].tolist(),
    ]
    assert streams[1].index["num_documents"] == int(np.count_nonzero(ids[20_000:] == EOD))
    # Expected: the same mixture over the old, copied layout of the same ids.
    copied = [
        (_copied_shards(ids[:20_000], tmp_path / "old0"), 2.0),
        (_copied_shards(ids[20_000:], tmp_path / "old1"), 1.0),
    ]
    old = DataLoader(Mixture(copied, 64, 0.05, seed=3), 8, 0, 1)
    for _ in range(5):
        (x, y), (xo, yo) = loader.next_batch(), old.next_batch()
        assert x.tolist() == xo.tolist() and y.tolist() == yo.tolist()
    # Spelled out: sample g is a window of a source's ids, inputs then targets shifted by one.
    _, src, win = loader.mixture._epoch
    first = ids[:20_000] if src[40] == 0 else ids[20_000:]
    assert loader.mixture.sample(40).tolist() == first[win[40] * 64 : win[40] * 64 + 65].tolist()
    for (x, y), (xo, yo) in zip(loader.val_batches(16, 4), old.val_batches(16, 4), strict=True):
        assert x.tolist() == xo.tolist() and y.tolist() == yo.tolist()
    # The checkpointed state is the same and resumes to the same batch.
    assert loader.state_dict() == old.state_dict()
    again = build_loader(cfg, ByteTokenizer(), 8, 0, 1, seed=3, log=QUIET)
    again.load_state_dict(old.state_dict())
    assert again.next_batch()[0].tolist() == old.next_batch()[0].tolist()


def test_a_changed_token_file_is_indexed_anew_and_never_read_by_its_old_index(tmp_path):
    path = tmp_path / "t.bin"
    _ids(5_000).astype(np.uint16).tofile(path)
    src = SourceConfig(path=str(path), format="tokens", dtype="uint16")
    first = _prepare(src, tmp_path / "cache")
    assert TokenShards(first).num_tokens == 5_000
    with open(path, "ab") as f:  # a longer file: another size
        _ids(1_000, seed=1).astype(np.uint16).tofile(f)
    with pytest.raises(UserError, match=r"t.bin changed \(size or modification time\) since it was indexed"):
        TokenShards(first)
    second = _prepare(src, tmp_path / "cache")
    assert second != first and TokenShards(second).num_tokens == 6_000
    # The same size, rewritten: the modification time tells.
    ids = _ids(6_000, seed=2)
    ids.astype(np.uint16).tofile(path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    third = _prepare(src, tmp_path / "cache")
    assert third not in (first, second) and TokenShards(third).window(0, 6_000).tolist() == ids.tolist()
    path.unlink()
    with pytest.raises(UserError, match="cannot be read"):
        TokenShards(third)


_RSS = """
import os, sys
from scaletrain.config import DataConfig, SourceConfig
from scaletrain.data.loader import build_loader
from scaletrain.data.tokenizer import ByteTokenizer

def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

path, cache = sys.argv[1:]
before = rss()
cfg = DataConfig(sources=[SourceConfig(path=path, format="tokens", dtype="uint16")], cache_dir=cache, seq_len=256)
loader = build_loader(cfg, ByteTokenizer(), 16, 0, 1, seed=0, log=lambda s: None)
for _ in range(20):
    loader.next_batch()
print(rss() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads resident memory from /proc")
def test_opening_a_large_token_file_does_not_make_it_resident(tmp_path):
    path = tmp_path / "big.bin"
    chunk = _ids(1 << 22).astype(np.uint16)  # 8 MiB, written 25 times: 200 MiB
    with open(path, "wb") as f:
        for _ in range(25):
            chunk.tofile(f)
    size = path.stat().st_size
    # In a fresh process: index the file (one pass over it), then read 20 batches of random windows from it.
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_RSS), str(path), str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        check=True,
    )
    grown = int(proc.stdout.split()[-1])
    # The scan's 32 MiB buffer, the epoch's order and torch's first batch; not the file's 200 MiB.
    assert grown < size // 3, (
        f"resident memory grew by {grown / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB file"
    )
    assert _cache_bytes(tmp_path / "cache") < 4096
