"""Where documents come from: resolve a source's path to files and read documents out of text, jsonl, parquet or a
Hugging Face datasets directory (save_to_disk), or token ids out of pre-tokenised .bin/.npy files.

Also names the default corpus: the running interpreter's standard-library sources, present on every machine.
Text is read as strict UTF-8: what does not decode is left out and counted (or refused), never replaced.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from scaletrain.config import SourceConfig
from scaletrain.errors import UserError

if TYPE_CHECKING:
    import pyarrow as pa

_EXCLUDED_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib"}
# How much of a file is searched for a NUL byte to call it binary (git's heuristic looks at the first 8000 bytes).
_SNIFF_BYTES = 8192
# Skipped files and lines named in the warning; the rest are only counted.
_EXAMPLES = 5
CONVERT_HINT = "convert text to UTF-8 (e.g. iconv -f LATIN1 -t UTF-8 IN > OUT)"


@dataclass
class Skipped:
    """Files and lines left out because they are not UTF-8 text: counted, the first few named for the warning.

    Crosses from tokenising workers back to the parent by pickle, so it stays plain data."""

    files: int = 0
    lines: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, what: str, reason: str, whole_file: bool) -> None:
        if whole_file:
            self.files += 1
        else:
            self.lines += 1
        if len(self.examples) < _EXAMPLES:
            self.examples.append(f"{what} ({reason})")

    def update(self, other: Skipped) -> None:
        self.files += other.files
        self.lines += other.lines
        self.examples += other.examples[: _EXAMPLES - len(self.examples)]

    def __bool__(self) -> bool:
        return bool(self.files or self.lines)

    def counts(self) -> str:
        """'2 file(s) and 1 line(s)'."""
        return " and ".join(f"{n} {what}(s)" for n, what in ((self.files, "file"), (self.lines, "line")) if n)

    def named(self) -> str:
        """'a.png (binary: a NUL byte at offset 8), b.jsonl:3 (invalid UTF-8 at offset 4) and 7 more'."""
        more = self.files + self.lines - len(self.examples)
        return ", ".join(self.examples) + (f" and {more} more" if more > 0 else "")

    def describe(self) -> str:
        return f"{self.counts()} that are not UTF-8 text: {self.named()}"


def _where(index: int | None) -> str:
    return f"data.sources[{index}]" if index is not None else "data.sources[i]"


def list_files(src: SourceConfig, index: int) -> list[Path]:
    """The files a source names (a file, a directory searched recursively, or a glob), sorted."""
    where = _where(index)
    if not src.path:
        raise UserError(f"{where}.path is empty; give a file, a directory or a glob")
    path = Path(src.path).expanduser()
    if path.is_dir() and (src.format == "hf_disk" or (src.format == "auto" and _is_datasets_dir(path))):
        return hf_disk_files(path, where)
    files = _matching(src, path, where)
    if src.format == "tokens" or all(resolve_format(p, src.format) == "tokens" for p in files):
        # Megatron keeps a .idx (document offsets) beside each .bin: the .bin alone is the token stream.
        files = [p for p in files if p.suffix.lower() != ".idx"] or files
        check_token_files(files, src.dtype, where)
    elif src.dtype:
        raise UserError(
            f'{where}.dtype ({src.dtype}) is for pre-tokenised files only: set {where}.format = "tokens" to read '
            f"{src.path!r} as token ids, or leave {where}.dtype empty"
        )
    return files


def _matching(src: SourceConfig, path: Path, where: str) -> list[Path]:
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = [p for p in path.rglob("*") if p.is_file()]
    else:
        files = [Path(p) for p in glob.glob(str(path), recursive=True)]
        files = [p for p in files if p.is_file()]
    if not files:
        raise UserError(
            f"{where}.path {src.path!r} matches no files; give an existing file, a directory or a glob "
            "(e.g. 'data/**/*.jsonl')"
        )
    files.sort()
    if all(p.stat().st_size == 0 for p in files):
        raise UserError(
            f"{where}.path {src.path!r} matches {len(files)} file(s), all empty; point it at your data"
        )
    return files


def resolve_format(path: Path, fmt: str) -> str:
    """`auto` picks by suffix: .jsonl/.json → jsonl, .parquet → parquet, .arrow → hf_disk, .npy → tokens, anything
    else → text."""
    if fmt != "auto":
        return fmt
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    if suffix == ".arrow":
        return "hf_disk"
    if suffix == ".npy":
        return "tokens"
    return "text"


def _binary(head: bytes) -> str | None:
    """Why bytes that start a file are not text, or None: a UTF-16 byte-order mark, or a NUL byte (images,
    archives and compiled files have them; UTF-8 text has none)."""
    if head[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return "UTF-16 text"
    nul = head.find(b"\0")
    return f"binary: a NUL byte at offset {nul}" if nul >= 0 else None


def not_text(data: bytes) -> str | None:
    """Why `data` is not UTF-8 text ('binary: a NUL byte at offset 8', 'invalid UTF-8 at offset 3'), or None."""
    if (reason := _binary(data)) is not None:
        return reason
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"invalid UTF-8 at offset {e.start}"
    return None


def read_documents(
    path: Path, fmt: str, field: str, index: int | None = None, skipped: Skipped | None = None
) -> Iterator[str]:
    """Yield the documents of one file; `index` (the source's position) only sharpens error messages.

    Text that is not UTF-8 is never decoded with replacement characters, which would train the model on garbage.
    With `skipped`, it is left out and counted there: a binary or non-UTF-8 file as a whole (even one bad byte in a
    text file leaves out the file, since the file is one document and its extent is unknown), and a jsonl line
    that does not decode on its own. The caller warns, naming them, and refuses a source with nothing left.
    Without `skipped` it is refused here, naming the file and the offset of the first bad byte."""
    fmt = resolve_format(path, fmt)
    if fmt == "text":
        data = path.read_bytes()
        reason = not_text(data)
        if reason is None:
            yield data.decode("utf-8")
        else:
            _skip(str(path), reason, True, skipped, index)
    elif fmt == "jsonl":
        yield from _read_jsonl(path, field, index, skipped)
    elif fmt == "parquet":
        yield from _read_parquet(path, field, index)
    elif fmt == "hf_disk":
        yield from _read_arrow(path, field, index)
    elif fmt == "tokens":
        raise UserError(
            f"{path} holds token ids, not text ({_where(index)}.format tokens): they need no tokenizer, and none "
            "can be trained on them; train the tokenizer on the text they were made from"
        )
    else:
        raise UserError(
            f"{_where(index)}.format {fmt!r} is unknown; use auto, text, jsonl, parquet, hf_disk or tokens"
        )


def _skip(what: str, reason: str, whole_file: bool, skipped: Skipped | None, index: int | None) -> None:
    if skipped is None:
        raise UserError(
            f"{what} is not UTF-8 text ({reason}); {CONVERT_HINT} or remove it from {_where(index)}.path"
        )
    skipped.add(what, reason, whole_file)


def _read_jsonl(path: Path, field: str, index: int | None, skipped: Skipped | None) -> Iterator[str]:
    where = _where(index)
    with open(path, "rb") as f:
        # A binary file (a gzipped .jsonl, say) is left out whole, not reported as its first unparsable line.
        if (reason := _binary(f.read(_SNIFF_BYTES))) is not None:
            _skip(str(path), reason, True, skipped, index)
            return
        f.seek(0)
        for lineno, raw in enumerate(f, start=1):
            # Each line is decoded on its own: one bad line is one document left out, not the whole file.
            if (reason := not_text(raw)) is not None:
                _skip(f"{path}:{lineno}", reason, False, skipped, index)
                continue
            line = raw.decode("utf-8")
            if not line.strip():
                continue  # blank lines (often a trailing newline) are not documents
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{path}:{lineno} is not a JSON object ({e.msg}); each line of a jsonl source must be one "
                    f"object with the text under {field!r}, or set {where}.format"
                ) from None
            if not isinstance(obj, dict) or field not in obj:
                keys = ", ".join(map(repr, obj)) if isinstance(obj, dict) else type(obj).__name__
                raise UserError(
                    f"{path}:{lineno} has no field {field!r} (found: {keys}); set {where}.field to the key "
                    "that holds the text"
                )
            value = obj[field]
            if not isinstance(value, str):
                raise UserError(
                    f"{path}:{lineno}: field {field!r} holds {type(value).__name__}, not text; set {where}.field "
                    "to the key that holds the text"
                )
            yield value


def _read_parquet(path: Path, field: str, index: int | None) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError with a one-line reason
        raise UserError(
            f"{path} is not a readable parquet file ({e}); fix the file or set {_where(index)}.format"
        ) from None
    schema = pf.schema_arrow
    if field not in schema.names:
        raise UserError(
            f"{path} has no column {field!r} (columns: {', '.join(schema.names)}); set {_where(index)}.field to "
            "the column that holds the text"
        )
    column_type = schema.field(field).type
    if not _is_string(column_type):
        # Numbers, bytes or lists would reach the tokenizer as Python objects and fail there, far from the cause.
        strings = ", ".join(repr(f.name) for f in schema if _is_string(f.type)) or "none in this file"
        raise UserError(
            f"{path}: column {field!r} holds {column_type}, not strings; set {_where(index)}.field to a string "
            f"column (here: {strings}), or write the text as a string column"
        )
    # One row group at a time keeps memory bounded by the row-group size, not the file size.
    for rg in range(pf.num_row_groups):
        column = pf.read_row_group(rg, columns=[field]).column(0)
        for value in column.to_pylist():
            if value is not None:
                yield value


def _is_string(t: pa.DataType) -> bool:
    """Arrow types whose values read back as Python str: string, large_string, string_view, dictionaries of them."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    is_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16 only
    return pa.types.is_string(t) or pa.types.is_large_string(t) or is_view(t)


# -- Hugging Face datasets directories (Dataset.save_to_disk), read with pyarrow: datasets is not needed ------------
def _is_datasets_dir(path: Path) -> bool:
    """What save_to_disk writes: state.json and dataset_info.json beside the arrow files of a Dataset, or
    dataset_dict.json above one such directory per split of a DatasetDict."""
    return any((path / name).is_file() for name in ("state.json", "dataset_info.json", "dataset_dict.json"))


def hf_disk_files(path: Path, where: str) -> list[Path]:
    """The arrow files of a save_to_disk directory, in the order its state.json lists them (the row order)."""
    if (path / "dataset_dict.json").is_file():
        splits = [str(s) for s in _json(path / "dataset_dict.json").get("splits", [])]
        raise UserError(
            f"{path} holds a DatasetDict (splits: {', '.join(splits) or 'none'}); set {where}.path to the "
            f"directory of one split, e.g. '{path / (splits[0] if splits else 'train')}'"
        )
    state = path / "state.json"
    if not state.is_file():
        raise UserError(
            f"{path} has no state.json, so it is not a directory written by datasets' save_to_disk; save it with "
            f"Dataset.save_to_disk, or set {where}.format to how its files are written"
        )
    entries = _json(state).get("_data_files")
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) and "filename" in e
                                                                for e in entries):  # fmt: skip
        raise UserError(f"{state} lists no data files (_data_files); save the dataset again")
    files = [path / str(e["filename"]) for e in entries]
    if missing := [f.name for f in files if not f.is_file()]:
        raise UserError(
            f"{path} is incomplete: its state.json names {', '.join(missing)}, which is not there; copy the whole "
            "directory, or save the dataset again"
        )
    return files


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not readable JSON ({e}); save the dataset again") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} holds {type(data).__name__}, not a JSON object; save the dataset again")
    return data


def _read_arrow(path: Path, field: str, index: int | None) -> Iterator[str]:
    """The rows of one arrow file of a save_to_disk directory, a record batch at a time. datasets writes the Arrow
    IPC streaming format (pa.ipc.new_stream), memory-mapped here as datasets itself does."""
    import pyarrow as pa

    where = _where(index)
    try:
        with pa.memory_map(str(path)) as source:
            reader = pa.ipc.open_stream(source)
            schema = reader.schema
            if field not in schema.names:
                raise UserError(
                    f"{path} has no column {field!r} (columns: {', '.join(schema.names)}); set {where}.field to "
                    "the column that holds the text"
                )
            if not _is_string(schema.field(field).type):
                raise UserError(
                    f"{path}: column {field!r} holds {schema.field(field).type}, not strings; set {where}.field "
                    "to a string column"
                )
            for batch in reader:
                yield from (v for v in batch.column(field).to_pylist() if v is not None)
    except (pa.ArrowException, OSError) as e:
        raise UserError(
            f"{path} is not a readable Arrow stream file, as datasets' save_to_disk writes ({e}); it may be "
            f"truncated: save the dataset again, or set {where}.format"
        ) from None


# -- Pre-tokenised token files (nanoGPT / Megatron .bin, .npy) ----------------------------------------------------
def check_token_files(files: list[Path], dtype: str, where: str) -> None:
    """Refuse, before any work, what the file sizes show: a raw file with no dtype given, or whose byte count is
    not a whole number of tokens (truncated, or written with another dtype). A .npy is checked when read."""
    for p in files:
        if p.suffix.lower() == ".npy":
            continue
        if not dtype:
            raise UserError(
                f"{p} is a raw token file: set {where}.dtype to the dtype of its ids (uint16 for nanoGPT's .bin; "
                "uint16, uint32, int32 or int64), or save the ids as .npy, which carries its dtype"
            )
        size, item = p.stat().st_size, np.dtype(dtype).itemsize
        if size % item:
            raise UserError(
                f"{p} has {size} bytes, not a whole number of {dtype} tokens ({item} bytes each): it is truncated, "
                f"or {where}.dtype is not the dtype it was written with"
            )


def read_tokens(path: Path, dtype: str, index: int | None = None) -> np.ndarray:
    """The token ids of one file as a 1-D memory map: a .npy with its own dtype, else raw ids of `dtype`."""
    where = _where(index)
    if path.suffix.lower() != ".npy":
        check_token_files([path], dtype, where)
        return np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)
    try:
        ids = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise UserError(f"{path} is not a readable .npy file ({e}); it may be truncated") from None
    if ids.dtype.kind not in "iu":
        raise UserError(f"{path} holds {ids.dtype} values, not integer token ids; save the ids as integers")
    if ids.ndim != 1:
        raise UserError(
            f"{path} holds an array of shape {ids.shape}; a token file is one stream of ids: save it flat "
            "(ids.reshape(-1)), with the end-of-document ids between documents"
        )
    if dtype and np.dtype(dtype) != ids.dtype:
        raise UserError(
            f"{path} holds {ids.dtype} ids, but {where}.dtype says {dtype}: a .npy carries its own dtype; "
            f"leave {where}.dtype empty"
        )
    return ids


def check_token_ids(ids: np.ndarray, offset: int, path: Path, vocab_size: int) -> None:
    """Refuse ids the tokenizer's vocabulary does not have (another tokenizer made them), naming the first."""
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        raise UserError(
            f"{path}: token id {int(ids[bad[0]])} at position {offset + int(bad[0])} is outside the tokenizer's "
            f"vocabulary (0..{vocab_size - 1}); these ids were made by another tokenizer: set data.tokenizer to "
            "the one that made them"
        )


def embedded_corpus_files() -> list[Path]:
    """The interpreter's standard-library .py files (~11 MB of real text): the corpus when no source is given."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune below the stdlib root only, so a stdlib installed under e.g. /opt/test/ still counts.
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_STDLIB_DIRS]
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(p for p in files if p.is_file())
