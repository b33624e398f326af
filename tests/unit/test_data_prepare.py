"""Tokenisation into cached shards: layout, determinism across worker counts, cache reuse and crash safety."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest

from scaletrain.config import DataConfig, SourceConfig
from scaletrain.data import prepare
from scaletrain.data.loader import TokenShards
from scaletrain.data.prepare import prepare_data, resolve_cache_dir, token_dtype
from scaletrain.data.sources import Skipped
from scaletrain.data.tokenizer import ByteTokenizer, train_bpe
from scaletrain.errors import UserError


def _corpus(root: Path, n_files: int = 5) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        rows = [{"text": f"file {i} doc {j} " + "xyz" * (i * 7 + j)} for j in range(i + 1)]
        (root / f"part-{i:02d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _cfg(data: Path, cache: Path, workers: int = 1, **kw) -> DataConfig:
    return DataConfig(sources=[SourceConfig(path=str(data), **kw)], cache_dir=str(cache), workers=workers)


def _dir_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_layout_eod_after_every_document(tmp_path: Path):
    data = tmp_path / "docs.jsonl"
    data.write_text('{"text": "ab"}\n{"text": "\\u00e9"}\n{"text": ""}\n')
    [(d, w)] = prepare_data(_cfg(data, tmp_path / "c"), ByteTokenizer(), log=lambda s: None)
    assert w == 1.0 and d.parent == tmp_path / "c" / "shards"
    index = json.loads((d / "index.json").read_text())
    assert index["version"] == 1 and index["dtype"] == "uint16"
    assert (index["vocab_size"], index["eod_id"], index["num_documents"]) == (257, 256, 3)
    expected = [97, 98, 256, 0xC3, 0xA9, 256, 256]
    assert index["num_tokens"] == len(expected) and index["files"] == [str(data)]
    assert np.fromfile(d / index["shards"][0]["file"], dtype=np.uint16).tolist() == expected


def test_output_is_the_same_for_one_and_two_workers(tmp_path: Path):
    data = _corpus(tmp_path / "data", n_files=6)
    [(d1, _)] = prepare_data(_cfg(data, tmp_path / "c1", workers=1), ByteTokenizer(), log=lambda s: None)
    [(d2, _)] = prepare_data(_cfg(data, tmp_path / "c2", workers=2), ByteTokenizer(), log=lambda s: None)
    assert d1.name == d2.name  # the cache key does not depend on the worker count
    assert _dir_bytes(d1) == _dir_bytes(d2)
    assert json.loads((d1 / "index.json").read_text())["num_documents"] == 21


def _worker_sigterm_is_default(_path) -> bool:
    return signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_workers_stop_on_sigterm_even_when_the_trainer_catches_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # The trainer turns SIGTERM into a preemption flag before it prepares data; forked pool workers inherited that
    # handler, ignored Pool.terminate() and hung the run (seen in CI). Workers must restore the default action.
    previous = signal.signal(signal.SIGTERM, lambda *a: None)
    try:
        monkeypatch.setattr(
            prepare,
            "tokenize_file",
            lambda path, job: (np.array([_worker_sigterm_is_default(path)], "uint16"), 1, Skipped()),
        )
        job = prepare.TokenizeJob(ByteTokenizer(), "text", "text", 0, "uint16")
        files = [tmp_path / f"f{i}" for i in range(4)]
        results = [t.tolist() for t, *_ in prepare._tokenized(files, job, workers=2, part_dir=tmp_path)]
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert results == [[1]] * 4


def test_hf_tokenizer_in_worker_processes(tmp_path: Path):
    data = _corpus(tmp_path / "data", n_files=4)
    tok = train_bpe(["file doc xyzxyz " * 8, "hello world"], vocab_size=300, out_path=tmp_path / "tok.json")
    [(d1, _)] = prepare_data(_cfg(data, tmp_path / "c1", workers=1), tok, log=lambda s: None)
    [(d2, _)] = prepare_data(_cfg(data, tmp_path / "c2", workers=2), tok, log=lambda s: None)
    assert _dir_bytes(d1) == _dir_bytes(d2)
    shards = TokenShards(d1)
    stream = shards.window(0, shards.num_tokens)
    docs = [tok.decode(ids) for ids in np.split(stream, np.flatnonzero(stream == tok.eod_id) + 1)[:-1]]
    assert docs[:2] == ["file 0 doc 0 ", "file 1 doc 0 " + "xyz" * 7]
    assert len(docs) == 10


def test_cache_hit_reuses_without_tokenising(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    data = _corpus(tmp_path / "data")
    logs: list[str] = []
    [(d1, _)] = prepare_data(_cfg(data, tmp_path / "c"), ByteTokenizer(), log=logs.append)
    assert "wrote" in logs[-1]

    def boom(*args, **kwargs):
        raise AssertionError("re-tokenised on a cache hit")

    monkeypatch.setattr(prepare, "tokenize_file", boom)
    [(d2, _)] = prepare_data(_cfg(data, tmp_path / "c"), ByteTokenizer(), log=logs.append)
    assert d2 == d1 and "cache hit" in logs[-1]
    # A changed file is a new key, so it is tokenised again.
    (data / "part-00.jsonl").write_text('{"text": "changed and longer"}\n')
    with pytest.raises(AssertionError, match="re-tokenised"):
        prepare_data(_cfg(data, tmp_path / "c"), ByteTokenizer(), log=logs.append)


def test_cache_key_depends_on_field_and_tokenizer(tmp_path: Path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a", "body": "b"}\n')
    quiet = lambda s: None  # noqa: E731
    [(a, _)] = prepare_data(_cfg(data, tmp_path / "c"), ByteTokenizer(), log=quiet)
    [(b, _)] = prepare_data(_cfg(data, tmp_path / "c", field="body"), ByteTokenizer(), log=quiet)
    tok = train_bpe(["a b"], vocab_size=260, out_path=tmp_path / "t.json")
    [(c, _)] = prepare_data(_cfg(data, tmp_path / "c"), tok, log=quiet)
    assert len({a, b, c}) == 3


def test_failed_tokenisation_leaves_no_prepared_dir(tmp_path: Path):
    data = _corpus(tmp_path / "data", n_files=3)
    (data / "part-02.jsonl").write_text('{"text": "fine"}\nnot json\n')
    for workers in (1, 2):
        with pytest.raises(UserError, match="part-02.jsonl:2"):
            prepare_data(_cfg(data, tmp_path / "c", workers=workers), ByteTokenizer(), log=lambda s: None)
    assert list((tmp_path / "c" / "shards").iterdir()) == []


def test_shards_split_and_read_back_as_one_stream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    data = _corpus(tmp_path / "data")
    [(whole, _)] = prepare_data(_cfg(data, tmp_path / "c1"), ByteTokenizer(), log=lambda s: None)
    monkeypatch.setattr(prepare, "SHARD_TOKENS", 7)
    [(split, _)] = prepare_data(_cfg(data, tmp_path / "c2"), ByteTokenizer(), log=lambda s: None)
    index = json.loads((split / "index.json").read_text())
    assert len(index["shards"]) > 3 and all(s["num_tokens"] <= 7 for s in index["shards"])
    a, b = TokenShards(whole), TokenShards(split)
    assert a.num_tokens == b.num_tokens == index["num_tokens"]
    full = a.window(0, a.num_tokens)
    assert np.array_equal(b.window(0, b.num_tokens), full)
    for start, length in [(0, 7), (5, 3), (6, 9), (13, 20), (b.num_tokens - 4, 4)]:
        assert np.array_equal(b.window(start, length), full[start : start + length])
    with pytest.raises(IndexError):
        b.window(b.num_tokens - 2, 3)


def test_token_dtype():
    assert token_dtype(257) == token_dtype(65535) == "uint16"
    assert token_dtype(65536) == token_dtype(128256) == "uint32"


def test_resolve_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("SCALETRAIN_CACHE", str(tmp_path / "env"))
    assert resolve_cache_dir(DataConfig(cache_dir=str(tmp_path / "cfg"))) == tmp_path / "cfg"
    assert resolve_cache_dir(DataConfig()) == tmp_path / "env"
    monkeypatch.delenv("SCALETRAIN_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_cache_dir(DataConfig()) == tmp_path / "home" / ".cache" / "scaletrain"


def test_embedded_corpus_is_the_default_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    corpus = _corpus(tmp_path / "stdlib", n_files=3)
    files = sorted(corpus.iterdir())
    # Stand in three small files for the 11 MB stdlib so the test stays fast.
    monkeypatch.setattr(prepare, "embedded_corpus_files", lambda: files)
    logs: list[str] = []
    [(d, w)] = prepare_data(
        DataConfig(cache_dir=str(tmp_path / "c"), workers=1), ByteTokenizer(), logs.append
    )
    index = json.loads((d / "index.json").read_text())
    assert w == 1.0 and index["files"] == [str(p) for p in files]
    assert index["num_documents"] == 3  # read as text: one document per file
    assert "embedded corpus" in logs[-1]
