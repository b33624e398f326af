"""Where documents come from: resolve a source's path to files and read documents out of text, jsonl or parquet.

Also names the default corpus: the running interpreter's standard-library sources, present on every machine.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from scaletrain.config import SourceConfig
from scaletrain.errors import UserError

_EXCLUDED_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib"}


def _where(index: int | None) -> str:
    return f"data.sources[{index}]" if index is not None else "data.sources[i]"


def list_files(src: SourceConfig, index: int) -> list[Path]:
    """The files a source names (a file, a directory searched recursively, or a glob), sorted."""
    where = _where(index)
    if not src.path:
        raise UserError(f"{where}.path is empty; give a file, a directory or a glob")
    path = Path(src.path).expanduser()
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
    """`auto` picks by suffix: .jsonl/.json → jsonl, .parquet → parquet, anything else → text."""
    if fmt != "auto":
        return fmt
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    return "text"


def read_documents(path: Path, fmt: str, field: str, index: int | None = None) -> Iterator[str]:
    """Yield the documents of one file; `index` (the source's position) only sharpens error messages."""
    fmt = resolve_format(path, fmt)
    if fmt == "text":
        yield path.read_bytes().decode("utf-8", errors="replace")
    elif fmt == "jsonl":
        yield from _read_jsonl(path, field, index)
    elif fmt == "parquet":
        yield from _read_parquet(path, field, index)
    else:
        raise UserError(f"{_where(index)}.format {fmt!r} is unknown; use auto, text, jsonl or parquet")


def _read_jsonl(path: Path, field: str, index: int | None) -> Iterator[str]:
    where = _where(index)
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
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
    columns = pf.schema_arrow.names
    if field not in columns:
        raise UserError(
            f"{path} has no column {field!r} (columns: {', '.join(columns)}); set {_where(index)}.field to "
            "the column that holds the text"
        )
    # One row group at a time keeps memory bounded by the row-group size, not the file size.
    for rg in range(pf.num_row_groups):
        column = pf.read_row_group(rg, columns=[field]).column(0)
        for value in column.to_pylist():
            if value is not None:
                yield value


def embedded_corpus_files() -> list[Path]:
    """The interpreter's standard-library .py files (~11 MB of real text): the corpus when no source is given."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune below the stdlib root only, so a stdlib installed under e.g. /opt/test/ still counts.
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_STDLIB_DIRS]
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(p for p in files if p.is_file())
