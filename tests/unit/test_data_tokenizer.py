"""Byte and Hugging Face tokenizers: round trips, end-of-document ids, fingerprints and errors for bad files."""

from __future__ import annotations

from pathlib import Path

import pytest

from scaletrain.data.tokenizer import (
    EOD_CANDIDATES,
    ByteTokenizer,
    HFTokenizer,
    fingerprint,
    load_tokenizer,
    train_bpe,
)
from scaletrain.errors import UserError

TEXTS = [
    "def hello(world):\n    return world + 1\n",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "import os\nimport sys\nprint(os.getcwd(), sys.argv)\n",
    "héllo wörld — ünïcode ✓",
] * 5


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(TEXTS, vocab_size=300, out_path=path)
    return path


def test_byte_round_trip_and_eod():
    tok = ByteTokenizer()
    text = "héllo\n✓ world"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.eod_id not in ids  # encode never appends eod
    assert tok.decode(ids + [tok.eod_id] + ids) == text + text  # decode drops eod
    assert (tok.vocab_size, tok.eod_id, tok.name) == (257, 256, "byte")
    assert tok.decode([0xFF]) == "\ufffd"  # invalid UTF-8 is replaced, not raised


def test_hf_bpe_round_trip(bpe_path: Path):
    tok = load_tokenizer(str(bpe_path))
    assert isinstance(tok, HFTokenizer)
    assert 257 <= tok.vocab_size <= 300
    assert tok.eod_token == "<|endoftext|>"
    for text in ["def hello(world):\n    return 2\n", "héllo wörld ✓ 東京", "unseen words: zyxwv"]:
        ids = tok.encode(text)
        assert tok.eod_id not in ids
        assert tok.decode(ids) == text
    # Merges were learned: frequent text takes fewer tokens than bytes.
    assert len(tok.encode(TEXTS[1])) < len(TEXTS[1].encode()) / 2
    assert tok.encode_batch(TEXTS[:2]) == [tok.encode(t) for t in TEXTS[:2]]


def test_train_bpe_refuses_to_overwrite(bpe_path: Path):
    before = bpe_path.read_bytes()
    with pytest.raises(UserError, match="already exists"):
        train_bpe(TEXTS, vocab_size=300, out_path=bpe_path)
    assert bpe_path.read_bytes() == before


def test_fingerprint_is_stable_and_content_based(bpe_path: Path, tmp_path: Path):
    assert fingerprint(ByteTokenizer()) == fingerprint(load_tokenizer("byte"))
    fp = fingerprint(load_tokenizer(str(bpe_path)))
    assert fp == fingerprint(load_tokenizer(str(bpe_path))) != fingerprint(ByteTokenizer())
    copy = tmp_path / "copy.json"
    copy.write_bytes(bpe_path.read_bytes())
    assert fingerprint(load_tokenizer(str(copy))) == fp  # same bytes, other path: same tokens
    other = train_bpe(TEXTS[:2], vocab_size=280, out_path=tmp_path / "other.json")
    assert fingerprint(other) != fp


def test_missing_tokenizer_file():
    with pytest.raises(UserError) as e:
        load_tokenizer("no/such/tokenizer.json")
    assert str(e.value) == (
        "data.tokenizer: 'no/such/tokenizer.json' does not exist; give 'byte' or the path of a tokenizer.json"
    )


def test_bad_tokenizer_file(tmp_path: Path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(UserError) as e:
        load_tokenizer(str(bad))
    msg = str(e.value)
    assert str(bad) in msg and "data.tokenizer" in msg
    assert "\n" not in msg  # one line, not the loader's traceback


def test_tokenizer_without_eod_token(tmp_path: Path):
    from tokenizers import Tokenizer, models

    path = tmp_path / "noeod.json"
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(path))
    with pytest.raises(UserError) as e:
        load_tokenizer(str(path))
    assert all(t in str(e.value) for t in EOD_CANDIDATES)
