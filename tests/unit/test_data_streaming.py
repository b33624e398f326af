"""data.streaming from local shards: each document once per epoch, a new shuffle each epoch, the mixture schedule and
its realised shares, exact continuation on another number of ranks or under a changed schedule (checked by
document ids), a dry source that stops the run, and the checks before launch. The S3 tests are in
test_data_stream_s3.py."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from scaletrain.config import DataConfig, MixStage, SourceConfig
from scaletrain.data.loader import data_problems
from scaletrain.data.schedule import MixtureSchedule, schedule_problems
from scaletrain.data.streaming import SourceDry, StreamingLoader, build_streaming_loader
from scaletrain.data.tokenizer import ByteTokenizer
from scaletrain.errors import UserError

SEQ = 16
_DOC = re.compile(r"<([a-z])(\d)(\d\d)>")


def write_corpus(root: Path, letters: str = "ab", shards: int = 3, docs: int = 8) -> list[Path]:
    """One directory of jsonl shards per source; document n of shard k of source `x` is "<xknn>" then filler:
    its id is in its text, and each source's letter fills its samples."""
    dirs = []
    for letter in letters:
        d = root / letter
        d.mkdir(parents=True)
        for k in range(shards):
            lines = [
                json.dumps({"text": f"<{letter}{k}{n:02d}>" + letter * (5 + n % 7)}) for n in range(docs)
            ]
            (d / f"part-{k}.jsonl").write_text("\n".join(lines) + "\n")
        dirs.append(d)
    return dirs


def data_cfg(paths: list[str], tmp: Path, **kw) -> DataConfig:
    weights = kw.pop("weights", [1.0] * len(paths))
    sources = [SourceConfig(path=p, weight=w) for p, w in zip(paths, weights)]
    return DataConfig(
        sources=sources, streaming=True, seq_len=SEQ, val_fraction=0, cache_dir=str(tmp / "c"), **kw
    )


def loader(cfg: DataConfig, batch: int = 4, rank: int = 0, ranks: int = 1, run_tokens: int = 100 * SEQ):
    return build_streaming_loader(cfg, ByteTokenizer(), batch, rank, ranks, 1234, run_tokens, lambda s: None)


def rows(x: torch.Tensor, y: torch.Tensor) -> list[list[int]]:
    """The samples of a batch, seq_len + 1 tokens each."""
    return torch.cat([x, y[:, -1:]], dim=1).tolist()


def source_streams(samples: list[list[int]]) -> dict[str, str]:
    """Each source's tokens as trained, in order (a sample's last token is the next one's first), as text with
    '|' for end of document; a sample's source is the filler letter it holds."""
    out: dict[str, str] = {}
    for s in samples:
        text = "".join("|" if t == 256 else chr(t) for t in s[:-1])
        letter = Counter(c for c in text if c.isalpha()).most_common(1)[0][0]
        out[letter] = out.get(letter, "") + text
    return out


def doc_ids(stream: str) -> list[str]:
    return ["".join(m) for m in _DOC.findall(stream)]


def test_each_document_once_per_epoch_then_a_new_shuffle(tmp_path: Path):
    [d] = write_corpus(tmp_path, "a", shards=5, docs=5)
    ld = loader(data_cfg([str(d)], tmp_path))
    samples = [r for _ in range(30) for r in rows(*ld.next_batch())]
    ids = doc_ids(source_streams(samples)["a"])
    every = sorted(f"a{k}{n:02d}" for k in range(5) for n in range(5))
    first, second = ids[:25], ids[25:50]
    assert sorted(first) == every and sorted(second) == every  # each epoch: every document once, none skipped
    shard_order = lambda ids: [i[1] for i in ids[::5]]  # noqa: E731
    assert shard_order(first) != shard_order(second)  # the second epoch reads the shards in another order
    assert all(
        ids[j : j + 5] == sorted(ids[j : j + 5]) for j in range(0, 50, 5)
    )  # a shard's documents in order


def test_schedule_stages_blends_and_realised_shares(tmp_path: Path):
    stages = [MixStage(start="50%", end="75%", weights=[0, 1]), MixStage(start="90%", weights=[1, 1])]
    s = MixtureSchedule([3, 1], stages, run_tokens=1000)
    assert s.weights(0).tolist() == [0.75, 0.25] and s.weights(499).tolist() == [0.75, 0.25]
    assert s.weights(625).tolist() == pytest.approx([0.375, 0.625])  # halfway through the blend
    assert s.weights(750).tolist() == [0, 1] and s.weights(900).tolist() == [0.5, 0.5]
    dirs = write_corpus(tmp_path)
    ld = loader(
        data_cfg([str(p) for p in dirs], tmp_path, weights=[3, 1], schedule=stages), run_tokens=40 * SEQ
    )
    shares = []
    for _ in range(10):
        ld.next_batch()
        shares.append(ld.shares()["data_share/source0"])
    # Steps of 4 samples at 16 tokens: steps 1-5 before the blend (3:1), then 0 once the blend ends at 75%.
    assert shares[:5] == [0.75] * 5 and shares[7:9] == [0.0, 0.0]


def run_steps(ld: StreamingLoader, steps: int) -> list[list[int]]:
    return [r for _ in range(steps) for r in rows(*ld.next_batch())]


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_resume_on_another_number_of_ranks_continues_every_source(tmp_path: Path, before: int, after: int):
    dirs = write_corpus(tmp_path)
    cfg = data_cfg([str(p) for p in dirs], tmp_path, weights=[2, 1])
    reference = run_steps(loader(cfg), 12)  # one rank, uninterrupted: 48 samples, past one epoch of each
    first = [loader(cfg, rank=r, ranks=before) for r in range(before)]
    trained = []
    for _ in range(5):
        parts = [rows(*ld.next_batch()) for ld in first]
        trained += [r for part in parts for r in part]  # ranks' slices in rank order = the global batch
    states = [ld.state_dict() for ld in first]
    assert all(s == states[0] for s in states)  # the position is the same on every rank
    second = [loader(cfg, rank=r, ranks=after) for r in range(after)]
    for ld in second:
        ld.load_state_dict(states[0])
    for _ in range(7):
        trained += [r for ld in second for r in rows(*ld.next_batch())]
    assert trained == reference  # the samples of each step are those of the uninterrupted run
    for letter, stream in source_streams(trained).items():
        ids = doc_ids(stream)
        assert len(set(ids[:24])) == len(ids[:24]) and Counter(i[0] for i in ids) == {letter: len(ids)}
        assert len(ids) >= 24 if letter == "a" else True  # source a went round a whole epoch: none skipped


def test_a_changed_schedule_continues_each_source_where_it_stopped(tmp_path: Path):
    dirs = write_corpus(tmp_path)
    paths = [str(p) for p in dirs]
    ld = loader(data_cfg(paths, tmp_path, weights=[1, 1]))
    trained = run_steps(ld, 4)
    state = ld.state_dict()
    changed = loader(
        data_cfg(paths, tmp_path, weights=[1, 1], schedule=[MixStage(start="0", weights=[1, 3])])
    )
    changed.load_state_dict(state)
    trained += run_steps(changed, 4)
    streams = source_streams(trained)
    # Each source read alone (the other weighted 0): its own stream, in its own order.
    alone = {x: source_streams(run_steps(loader(data_cfg(paths, tmp_path, weights=w)), 10))[x]
             for x, w in (("a", [1, 0]), ("b", [0, 1]))}  # fmt: skip
    for x in "ab":
        # Each source's trained tokens are its own stream from the start, without a gap or a repeat.
        assert alone[x].startswith(streams[x]) and len(streams[x]) > 4 * SEQ
    assert len(streams["b"]) == (8 + 12) * SEQ  # 16 samples at 1:1, then 16 at 1:3


def test_a_dry_source_ends_the_run_when_told(tmp_path: Path):
    [d] = write_corpus(tmp_path, "a", shards=1, docs=6)  # ~100 tokens: 6 samples of 16
    ld = loader(data_cfg([str(d)], tmp_path, when_dry="stop"), batch=2)
    for _ in range(2):
        ld.next_batch()
    with pytest.raises(SourceDry, match="read to its end.*when_dry") as dry:
        for _ in range(5):
            position = ld.state_dict()
            ld.next_batch()
    assert (dry.value.index, dry.value.name, dry.value.epoch) == (0, "source0", 1)
    # The whole batch or none of it: the position stays after the last whole batch (what the final save holds).
    assert ld.state_dict() == position and 0 < position["next_sample"] < 6
    again = loader(data_cfg([str(d)], tmp_path), batch=2)  # repeat: goes on into the next epoch
    assert len(run_steps(again, 10)) == 20


def test_streaming_config_is_checked_before_launch(tmp_path: Path):
    [d] = write_corpus(tmp_path, "a", shards=1)
    cfg = data_cfg([str(d), str(tmp_path / "missing")], tmp_path, weights=[0, 0])
    cfg.schedule = [MixStage(start="10%", weights=[1]), MixStage(start="5%", end="1%", weights=[-1, 1])]
    problems = data_problems(cfg) + schedule_problems(cfg, run_tokens=1000)
    text = "\n".join(problems)
    assert f"{tmp_path / 'missing'} does not exist" in text  # the URL, before step 1
    assert "empty mixture" in text  # every weight 0 before the first stage
    assert "schedule[0].weights has 1 value(s)" in text and "schedule[1].weights [-1, 1]" in text
    assert "end (1%) comes before start (5%)" in text and "before the previous stage ends" in text
    assert schedule_problems(DataConfig(schedule=[MixStage(weights=[1])]), 10) == [
        "data.schedule needs data.streaming = true (prepared shards mix by fixed weights)"
    ]


def test_a_rollback_past_bad_batches_moves_every_source_past_them(tmp_path: Path):
    dirs = write_corpus(tmp_path)
    cfg = data_cfg([str(p) for p in dirs], tmp_path, weights=[2, 1])
    reference = run_steps(loader(cfg), 8)
    ld = loader(cfg)
    run_steps(ld, 2)
    snapshot = ld.state_dict()
    run_steps(ld, 3)  # steps 3-5, then a spike: back to the snapshot, skipping them (resilience.guard)
    ld.load_state_dict({**snapshot, "next_sample": ld.state_dict()["next_sample"]})
    assert run_steps(ld, 3) == reference[5 * 4 :]


def test_a_position_over_a_changed_list_of_shards_is_refused(tmp_path: Path):
    [d] = write_corpus(tmp_path, "a")
    ld = loader(data_cfg([str(d)], tmp_path))
    run_steps(ld, 2)
    state = ld.state_dict()
    (d / "part-9.jsonl").write_text(json.dumps({"text": "<a900>new"}) + "\n")  # a shard added under the path
    with pytest.raises(UserError, match="shards changed since this position was saved"):
        loader(data_cfg([str(d)], tmp_path)).load_state_dict(state)


def test_parquet_and_text_shards_stream_the_documents_jsonl_does(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    [d] = write_corpus(tmp_path, "a", shards=2, docs=6)
    docs = {f.stem: [json.loads(line)["text"] for line in f.read_text().splitlines()] for f in d.iterdir()}
    (tmp_path / "pq").mkdir()
    (tmp_path / "txt").mkdir()
    for stem, texts in docs.items():
        pq.write_table(pa.table({"text": texts}), tmp_path / "pq" / f"{stem}.parquet", row_group_size=4)
        for n, text in enumerate(texts):  # a text file is one document
            (tmp_path / "txt" / f"{stem}-{n:02d}.txt").write_text(text)
    want = source_streams(run_steps(loader(data_cfg([str(d)], tmp_path), batch=1), 12))["a"]
    got = source_streams(run_steps(loader(data_cfg([str(tmp_path / "pq")], tmp_path), batch=1), 12))["a"]
    assert got == want
    texts = source_streams(run_steps(loader(data_cfg([str(tmp_path / "txt")], tmp_path), batch=1), 20))["a"]
    assert sorted(doc_ids(texts)[:12]) == sorted(doc_ids(want)[:12])  # each file once, in a shuffled order


def test_the_documented_streaming_example_is_valid_config():
    """docs/training.md's streaming example has only real keys of the right types, and a schedule that validates."""
    import tomllib

    from scaletrain.config import Config
    from scaletrain.config.io import to_dataclass

    text = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    [block] = re.findall(r"```toml\n(.*?)```", text.split("## Streaming from object storage", 1)[1], re.S)
    cfg, problems = to_dataclass(Config, tomllib.loads(block))
    assert problems == [] and cfg.data.streaming and len(cfg.data.schedule) == 2
    assert schedule_problems(cfg.data, run_tokens=10**10) == []
