"""Source resolution (file, directory, glob) and document reading from text, jsonl and parquet."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from scaletrain.config import SourceConfig
from scaletrain.data.sources import embedded_corpus_files, list_files, read_documents, resolve_format
from scaletrain.errors import UserError


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_text_file_is_one_document(tmp_path: Path):
    p = tmp_path / "a.txt"
    p.write_bytes("line one\nline two é\n".encode())
    docs = list(read_documents(p, "auto", "text"))
    assert docs == ["line one\nline two é\n"]  # bad UTF-8 is never replaced: see test_bad_input.py


def test_jsonl_one_document_per_line(tmp_path: Path):
    p = _write_jsonl(tmp_path / "a.jsonl", [{"text": "first", "id": 1}, {"text": "second\nline"}])
    p.write_text(p.read_text() + "\n")  # a trailing blank line is not a document
    assert list(read_documents(p, "auto", "text")) == ["first", "second\nline"]
    q = _write_jsonl(tmp_path / "b.json", [{"body": "x"}])
    assert list(read_documents(q, "jsonl", "body")) == ["x"]


def test_jsonl_bad_line_names_file_line_and_field(tmp_path: Path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(UserError) as e:
        list(read_documents(p, "jsonl", "text", index=3))
    assert f"{p}:2" in str(e.value)


def test_jsonl_missing_field_suggests_config_key(tmp_path: Path):
    p = _write_jsonl(tmp_path / "a.jsonl", [{"text": "ok"}, {"content": "no text key"}])
    with pytest.raises(UserError) as e:
        list(read_documents(p, "jsonl", "text", index=3))
    msg = str(e.value)
    assert f"{p}:2" in msg and "'text'" in msg and "data.sources[3].field" in msg and "'content'" in msg


def test_parquet_rows_across_row_groups(tmp_path: Path):
    p = tmp_path / "a.parquet"
    texts = [f"document {i}" for i in range(10)]
    pq.write_table(pa.table({"id": list(range(10)), "content": texts}), p, row_group_size=3)
    assert pq.ParquetFile(p).num_row_groups == 4
    assert list(read_documents(p, "auto", "content")) == texts


def test_parquet_missing_column_lists_columns(tmp_path: Path):
    p = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": [1], "content": ["x"]}), p)
    with pytest.raises(UserError) as e:
        list(read_documents(p, "parquet", "text", index=0))
    msg = str(e.value)
    assert "id, content" in msg and "data.sources[0].field" in msg


def test_auto_format_by_suffix():
    assert [resolve_format(Path(f"x{s}"), "auto") for s in (".jsonl", ".JSON", ".parquet", ".py", "")] == [
        "jsonl",
        "jsonl",
        "parquet",
        "text",
        "text",
    ]
    assert resolve_format(Path("x.jsonl"), "text") == "text"


def test_list_files_file_directory_and_glob(tmp_path: Path):
    for rel in ["b.txt", "a.txt", "sub/c.txt", "sub/deeper/d.jsonl"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    names = lambda files: [str(p.relative_to(tmp_path)) for p in files]  # noqa: E731
    assert names(list_files(SourceConfig(path=str(tmp_path / "a.txt")), 0)) == ["a.txt"]
    assert names(list_files(SourceConfig(path=str(tmp_path)), 0)) == [
        "a.txt",
        "b.txt",
        "sub/c.txt",
        "sub/deeper/d.jsonl",
    ]
    assert names(list_files(SourceConfig(path=str(tmp_path / "**/*.txt")), 0)) == [
        "a.txt",
        "b.txt",
        "sub/c.txt",
    ]


def test_list_files_missing_path(tmp_path: Path):
    with pytest.raises(UserError) as e:
        list_files(SourceConfig(path=str(tmp_path / "nope/*.jsonl")), 2)
    assert "data.sources[2].path" in str(e.value) and "matches no files" in str(e.value)


def test_list_files_all_empty(tmp_path: Path):
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.txt").write_text("")
    with pytest.raises(UserError, match=r"data.sources\[1\].path .* all empty"):
        list_files(SourceConfig(path=str(tmp_path)), 1)


def test_embedded_corpus_is_stdlib_source():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = embedded_corpus_files()
    assert len(files) > 100
    assert files == sorted(files)
    assert all(p.suffix == ".py" for p in files)
    assert root / "json" / "__init__.py" in files
    excluded = {"site-packages", "dist-packages", "idlelib", "test", "tests"}
    assert not any(excluded & set(p.relative_to(root).parts) for p in files)
