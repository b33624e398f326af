"""Tokenizers: a dependency-free byte tokenizer and a wrapper around Hugging Face `tokenizer.json` files.

Both expose `encode`, `encode_batch`, `decode`, `eod_id`, `vocab_size` and `name`; `fingerprint` keys the shard cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from scaletrain.errors import UserError, unwritable

# Looked up in this order; the first one present in the vocabulary ends each document.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


class Tokenizer(Protocol):
    eod_id: int
    vocab_size: int

    @property
    def name(self) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus one end-of-document id (256)."""

    eod_id = 256
    vocab_size = 257

    @property
    def name(self) -> str:
        return "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if int(i) != self.eod_id).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from a tokenizer.json file."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _HF

        self.path = Path(path)
        self._tok = _HF.from_file(str(self.path))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        eod = next((t for t in EOD_CANDIDATES if t in vocab), None)
        if eod is None:
            raise UserError(
                f"data.tokenizer: {str(self.path)!r} has no end-of-document token; looked for "
                f"{', '.join(EOD_CANDIDATES)}. Add one of them to the tokenizer's vocabulary."
            )
        self.eod_token = eod
        self.eod_id = vocab[eod]
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def name(self) -> str:
        return str(self.path)

    def encode(self, text: str) -> list[int]:
        # Special tokens (BOS etc.) are not added: documents are delimited by eod only, when packing.
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """'byte', or the path of a tokenizer.json; bad input raises UserError saying what to give instead."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(
            f"data.tokenizer: {spec!r} does not exist; give 'byte' or the path of a tokenizer.json"
        )
    if not path.is_file():
        raise UserError(
            f"data.tokenizer: {spec!r} is not a file; give 'byte' or the path of a tokenizer.json"
        )
    try:
        return HFTokenizer(path)
    except UserError:
        raise
    except Exception as e:  # the Rust loader raises plain Exceptions with a parser message
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(
            f"data.tokenizer: cannot load {str(path)!r} as a Hugging Face tokenizer.json ({reason}); "
            "give 'byte' or a valid tokenizer.json"
        ) from None


def fingerprint(tok: ByteTokenizer | HFTokenizer) -> str:
    """A short stable id of the tokenizer's behaviour, part of every shard cache key."""
    if isinstance(tok, ByteTokenizer):
        return "byte-v1"
    # Hash the file bytes, not the path: the same path may later hold a different tokenizer.
    return "hf-" + hashlib.sha256(tok.path.read_bytes()).hexdigest()[:16]


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: Path) -> HFTokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style) on `texts` and save it as a tokenizer.json."""
    out_path = Path(out_path)
    if out_path.exists():
        raise UserError(f"{str(out_path)!r} already exists; choose another output path or delete it first")
    try:
        # Claimed before training (minutes on a large corpus), so an unwritable place is refused at once; opened
        # exclusively ("x": never overwritten) with the umask's permissions.
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.open("x").close()
    except OSError as e:
        raise UserError(
            f"cannot write the tokenizer to {str(out_path)!r} ({unwritable(out_path, e)}); choose an output path in a "
            "writable directory"
        ) from None
    try:
        _train(texts, vocab_size, out_path)
    except BaseException:
        # A training that failed or was interrupted leaves nothing behind, not an empty tokenizer.json.
        out_path.unlink(missing_ok=True)
        raise
    return HFTokenizer(out_path)


def _train(texts: Iterable[str], vocab_size: int, out_path: Path) -> None:
    from tokenizers import Tokenizer as _HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = _HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        # All 256 byte symbols up front, so any text encodes without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out_path.write_text(tok.to_str(pretty=True))
