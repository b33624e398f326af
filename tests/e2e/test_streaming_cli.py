"""data.streaming through the real CLI against moto's S3 server on loopback: a run reading s3:// jsonl shards has
the losses of the same run reading the same files from a local path, bit for bit (one process); a run stopped on 2
ranks and continued on 1 continues the uninterrupted run (losses within the layout tolerance) and ends at the same
data position, every source's, so no sample was trained twice or skipped; `scaletrain data-position` prints it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaletrain.checkpoint.run_model import read_data_position
from scaletrain.cli import main
from scaletrain.data.streaming import describe_position
from tests.helpers import losses, per_step, train_cli
from tests.unit.test_data_streaming import write_corpus

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
from tests.unit.test_data_stream_s3 import BUCKET, S3Server, serving  # noqa: E402

RTOL = 1e-5  # fp32 on CPU, 2 data-parallel ranks against 1: the reduction order only (docs/parallelism.md)


def _config(tmp: Path, paths: list[str]) -> str:
    sources = "".join(f'[[data.sources]]\npath = "{p}"\nname = "{n}"\nweight = {w}\n\n'
                      for p, n, w in zip(paths, ["web", "code"], [2, 1]))  # fmt: skip
    text = f"""[model]
preset = "debug"
[data]
seq_len = 64
streaming = true
val_fraction = 0
cache_dir = "{tmp / "cache"}"
{sources}[[data.schedule]]
start = "50%"
weights = [1, 3]
[training]
steps = 4
global_batch = 8
micro_batch = 4
eval_interval = 0
deterministic = true
[metrics]
log_interval = 1
[checkpoint]
interval = 0
"""
    path = tmp / f"stream-{len(list(tmp.glob('stream-*')))}.toml"
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    local = tmp_path_factory.mktemp("corpus")
    with serving(S3Server(), BUCKET, write_corpus(local, shards=3, docs=40)):
        yield local


def test_s3_equals_local_and_a_2_rank_stop_continues_on_1(s3, tmp_path: Path, capsys):
    remote = _config(tmp_path, [f"s3://{BUCKET}/a/", f"s3://{BUCKET}/b/"])
    train_cli(tmp_path / "local", config=_config(tmp_path, [str(s3 / "a"), str(s3 / "b")]))
    train_cli(tmp_path / "s3", config=remote)
    reference = losses(tmp_path / "s3")
    shares = per_step(tmp_path / "s3", ("data_share/web", "data_share/code"))  # the realised mixture, logged
    assert shares[1] == pytest.approx((2 / 3, 1 / 3), abs=1 / 8) and shares[4] == pytest.approx(
        (1 / 4, 3 / 4), abs=1 / 8
    )
    assert reference == losses(tmp_path / "local") and len(reference) == 4  # bit for bit
    run = tmp_path / "resumed"
    assert train_cli(run, config=remote, nproc=2, run__stop_at_step=2, check=False).returncode == 75
    train_cli(run, config=remote)  # the same run continued on one process
    got = losses(run)
    assert sorted(got) == [1, 2, 3, 4]
    assert all(got[s] == pytest.approx(reference[s], rel=RTOL) for s in got), (got, reference)
    # Every source ends where the uninterrupted run's does: the same samples, none twice, none skipped.
    assert (
        main(["data-position", str(run), "--json"]) == 0
    )  # the command a user runs (in this process: no start-up)
    end = json.loads(capsys.readouterr().out)
    cfg, state, _ = read_data_position(tmp_path / "s3")
    assert end["sources"] == describe_position(cfg.data, state) and end["next_sample"] == 32
    # 16 samples at 2:1 (11 and 5), then 16 at 1:3 from 50% of the run's tokens (4 and 12)
    assert [s["samples"] for s in end["sources"]] == [11 + 4, 5 + 12]
