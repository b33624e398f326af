"""The data users already have: a Hugging Face datasets directory written by save_to_disk (read with pyarrow alone)
and pre-tokenised .bin/.npy token files (used as they are), through to the packed token stream, with the errors
of bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from scaletrain.config import Config, DataConfig, SourceConfig
from scaletrain.config.io import to_dataclass
from scaletrain.data import ByteTokenizer, TokenShards, prepare_data
from scaletrain.data.sources import list_files, read_documents
from scaletrain.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["first document", "second, with ünïcode", "", "third"]
EOD = ByteTokenizer.eod_id


def _stream(src: SourceConfig, cache: Path) -> np.ndarray:
    """The whole prepared token stream of one source, as the loader reads it."""
    ((prepared, _),) = prepare_data(
        DataConfig(sources=[src], cache_dir=str(cache)), ByteTokenizer(), log=lambda m: None
    )
    shards = TokenShards(prepared)
    return shards.window(0, shards.num_tokens)


def _bytes_of(docs: list[str]) -> list[int]:
    return [t for d in docs for t in (*d.encode(), EOD)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A directory written by the real datasets library (two arrow shards), and a DatasetDict beside it."""
    datasets = pytest.importorskip("datasets")
    root = tmp_path_factory.mktemp("hf")
    ds = datasets.Dataset.from_dict({"id": list(range(len(DOCS))), "text": DOCS})
    ds.save_to_disk(str(root / "ds"), num_shards=2)
    datasets.DatasetDict(train=ds, test=ds).save_to_disk(str(root / "dd"))
    return root


def test_hf_disk_directory_is_detected_and_read_in_order(saved, tmp_path):
    src = SourceConfig(path=str(saved / "ds"))  # format auto: state.json + dataset_info.json
    files = list_files(src, 0)
    assert [f.name for f in files] == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    assert [d for f in files for d in read_documents(f, "auto", "text")] == DOCS
    assert _stream(src, tmp_path).tolist() == _bytes_of(DOCS)
    explicit = SourceConfig(path=str(saved / "ds"), format="hf_disk")
    assert list_files(explicit, 0) == files


def test_hf_disk_bad_inputs(saved, tmp_path):
    with pytest.raises(
        UserError, match=r"DatasetDict \(splits: train, test\).*data.sources\[2\].path.*dd/train"
    ):
        list_files(SourceConfig(path=str(saved / "dd")), 2)
    arrow = list_files(SourceConfig(path=str(saved / "ds")), 0)[0]
    with pytest.raises(UserError, match=r"no column 'body' \(columns: id, text\).*data.sources\[1\].field"):
        list(read_documents(arrow, "hf_disk", "body", index=1))
    with pytest.raises(UserError, match="column 'id' holds int64, not strings"):
        list(read_documents(arrow, "hf_disk", "id", index=1))
    cut = tmp_path / "cut.arrow"
    cut.write_bytes(arrow.read_bytes()[:-40])  # a copy that stopped short
    with pytest.raises(UserError, match="not a readable Arrow stream file.*truncated"):
        list(read_documents(cut, "auto", "text"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "dataset_info.json").write_text("{}")
    with pytest.raises(UserError, match="no state.json"):
        list_files(SourceConfig(path=str(broken)), 0)
    (broken / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    with pytest.raises(UserError, match="incomplete: its state.json names data-00000-of-00001.arrow"):
        list_files(SourceConfig(path=str(broken)), 0)


def test_token_files_go_into_the_stream_as_they_are(tmp_path):
    ids = np.array([1, 2, 3, EOD, 250, 7, EOD, 0], dtype=np.uint16)
    np.save(tmp_path / "a.npy", ids.astype(np.int32))  # a .npy carries its own dtype
    assert _stream(SourceConfig(path=str(tmp_path / "a.npy")), tmp_path / "c1").tolist() == ids.tolist()
    # nanoGPT style: raw uint16 ids; Megatron's .idx beside the .bin is not read. Several files: one stream in
    # path order, no eod added between them.
    raw = tmp_path / "raw"
    raw.mkdir()
    ids[:5].tofile(raw / "part-0.bin")
    ids[5:].tofile(raw / "part-1.bin")
    (raw / "part-0.idx").write_bytes(b"MMIDIDX\x00\x00 not tokens")
    src = SourceConfig(path=str(raw), format="tokens", dtype="uint16")
    assert [p.name for p in list_files(src, 0)] == ["part-0.bin", "part-1.bin"]
    assert _stream(src, tmp_path / "c2").tolist() == ids.tolist()
    ids.astype(np.uint32).tofile(tmp_path / "wide.bin")
    wide = SourceConfig(path=str(tmp_path / "wide.bin"), format="tokens", dtype="uint32")
    assert _stream(wide, tmp_path / "c3").tolist() == ids.tolist()


def test_token_file_bad_inputs(tmp_path):
    def refused(src: SourceConfig, pattern: str) -> None:
        with pytest.raises(UserError, match=pattern):
            list_files(src, 3)
            _stream(src, tmp_path / "cache")

    bin_ = tmp_path / "t.bin"
    np.arange(10, dtype=np.uint16).tofile(bin_)
    refused(SourceConfig(path=str(bin_), format="tokens"), r"raw token file: set data.sources\[3\].dtype")
    with open(bin_, "ab") as f:
        f.write(b"\x01")  # an odd byte count: truncated, or not uint16
    refused(
        SourceConfig(path=str(bin_), format="tokens", dtype="uint16"),
        "21 bytes, not a whole number of uint16",
    )
    refused(
        SourceConfig(path=str(bin_), dtype="uint16"),
        r'dtype \(uint16\) is for pre-tokenised files only.*"tokens"',
    )
    np.save(tmp_path / "f.npy", np.ones(4, dtype=np.float32))
    refused(SourceConfig(path=str(tmp_path / "f.npy")), "holds float32 values, not integer token ids")
    np.save(tmp_path / "m.npy", np.ones((2, 3), dtype=np.uint16))
    refused(SourceConfig(path=str(tmp_path / "m.npy")), r"shape \(2, 3\); a token file is one stream")
    np.save(tmp_path / "i.npy", np.ones(4, dtype=np.int32))
    refused(
        SourceConfig(path=str(tmp_path / "i.npy"), dtype="uint16"), "holds int32 ids, but .*dtype says uint16"
    )
    cut = tmp_path / "cut.npy"
    cut.write_bytes((tmp_path / "i.npy").read_bytes()[:-3])
    refused(SourceConfig(path=str(cut)), r"cut.npy is not a readable .npy file")
    np.save(tmp_path / "v.npy", np.array([5, EOD, 300, 1], dtype=np.uint16))
    refused(
        SourceConfig(path=str(tmp_path / "v.npy")),
        r"v.npy: token id 300 at position 2 is outside .* \(0..256\)",
    )
    np.save(tmp_path / "n.npy", np.array([5, -1], dtype=np.int64))
    refused(SourceConfig(path=str(tmp_path / "n.npy")), "token id -1 at position 1")
    with pytest.raises(UserError, match="holds token ids, not text"):
        list(read_documents(tmp_path / "i.npy", "auto", "text"))


def test_the_documented_examples_are_valid_config():
    """Every TOML example of docs/launching.md's data formats section has only real keys of the right types."""
    text = (ROOT / "docs" / "launching.md").read_text()
    section = text.split("## Data formats", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```toml\n(.*?)```", section, re.S)
    assert len(blocks) >= 2
    import tomllib

    formats = set()
    for block in blocks:
        cfg, problems = to_dataclass(Config, tomllib.loads(block))
        assert problems == [], block
        formats |= {s.format for s in cfg.data.sources}
    assert {"hf_disk", "tokens"} <= formats
