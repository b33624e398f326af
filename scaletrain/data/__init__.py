"""Data: tokenizers, source reading, tokenisation into cached shards, and the packed, mixed, resumable loader."""

from __future__ import annotations

from scaletrain.data.loader import DataLoader, Mixture, TokenShards, build_loader, split_windows
from scaletrain.data.prepare import prepare_data, resolve_cache_dir
from scaletrain.data.sources import embedded_corpus_files, list_files, read_documents
from scaletrain.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    fingerprint,
    load_tokenizer,
    train_bpe,
)

__all__ = [
    "ByteTokenizer",
    "DataLoader",
    "HFTokenizer",
    "Mixture",
    "TokenShards",
    "Tokenizer",
    "build_loader",
    "embedded_corpus_files",
    "fingerprint",
    "list_files",
    "load_tokenizer",
    "prepare_data",
    "read_documents",
    "resolve_cache_dir",
    "split_windows",
    "train_bpe",
]
