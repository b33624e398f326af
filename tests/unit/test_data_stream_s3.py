"""data.streaming against a real S3 API: moto's server started on loopback by this module (botocore and s3fs speak
HTTP to it as to AWS), not a mock of fsspec. The same files streamed from s3:// and read locally give the same
samples; a fetch that fails while the server is down is retried without losing or repeating a sample; the endpoint
comes from AWS_ENDPOINT_URL or the source's config; a source that cannot be listed is refused before step 1."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scaletrain.config import SourceConfig
from scaletrain.data import storage
from scaletrain.data.loader import data_problems
from scaletrain.data.storage import list_shards, source_filesystem
from tests.unit.test_data_streaming import data_cfg, loader, run_steps, write_corpus

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

BUCKET = "corpus"
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class S3Server:
    """moto's S3 server on a loopback port; stop() and start() again keep its buckets (moto's in-process state)."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = None

    def start(self) -> None:
        self._server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        self._server.stop()
        # moto's stop() leaves its socket listening, so that a request then waits in the backlog instead of failing
        # as it does against a store that restarts; closed here, the port refuses connections until start().
        self._server._server.server_close()


@contextlib.contextmanager
def serving(server, bucket: str, corpora: list[Path]) -> Iterator[None]:
    """`server` (anything with start, stop and url) started, the AWS environment pointed at it (what the training
    processes inherit too), each corpus directory uploaded under s3://BUCKET/<its name>/; all undone after."""
    saved = {k: os.environ.get(k) for k in [*AWS_ENV, "AWS_ENDPOINT_URL"]}
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server.start()
    os.environ.update(AWS_ENV, AWS_ENDPOINT_URL=server.url)
    import boto3

    client = boto3.client("s3")
    client.create_bucket(Bucket=bucket)
    for d in corpora:
        for f in sorted(d.iterdir()):
            client.upload_file(str(f), bucket, f"{d.name}/{f.name}")
    try:
        yield
    finally:
        server.stop()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[S3Server, Path]]:
    """The server, with the corpus of test_data_streaming uploaded under s3://corpus/{a,b}/; and its local copy."""
    local, server = tmp_path_factory.mktemp("corpus"), S3Server()
    with serving(server, BUCKET, write_corpus(local, shards=4, docs=6)):
        yield server, local


def test_streamed_and_local_files_give_the_same_samples(s3, tmp_path: Path):
    _, local = s3
    remote = data_cfg([f"s3://{BUCKET}/a/", f"s3://{BUCKET}/b"], tmp_path, weights=[2, 1])
    reference = run_steps(
        loader(data_cfg([str(local / "a"), f"file://{local / 'b'}"], tmp_path, weights=[2, 1])), 8
    )
    cold = loader(remote)
    assert run_steps(cold, 8) == reference  # bit for bit, in the same order
    cold.close()  # waits for the fetches under way
    assert cold.streams[0].cache.fetched >= 4 and not list((tmp_path / "c" / "stream").glob("*.part*"))
    warm = loader(remote)  # a second start finds the shards in the cache
    assert run_steps(warm, 8) == reference and warm.streams[0].cache.hits >= 4


def test_a_fetch_failing_while_the_server_is_down_is_retried(s3, tmp_path: Path, caplog):
    server, local = s3
    cfg = data_cfg([f"s3://{BUCKET}/a/", f"s3://{BUCKET}/b/"], tmp_path, read_ahead=0)
    reference = run_steps(loader(data_cfg([str(local / "a"), str(local / "b")], tmp_path)), 12)
    ld = loader(cfg)
    trained = run_steps(ld, 2)  # the first shard of each source, fetched while the server is up
    server.stop()
    restart = threading.Timer(1.2, server.start)  # down for ~1 s: the first attempts fail, a later one reads
    restart.start()
    try:
        with caplog.at_level(logging.WARNING, logger="scaletrain"):
            trained += run_steps(ld, 10)  # into the next shards: fetched while the server is down, then up
    finally:
        restart.join()
    assert "trying again" in caplog.text  # a fetch did fail
    assert trained == reference  # and no sample was lost or repeated


def test_a_listing_while_the_server_is_down_is_retried(s3, caplog):
    server, _ = s3
    src = SourceConfig(path=f"s3://{BUCKET}/a/")
    fs = source_filesystem(src, 0)
    fs.ls(BUCKET, refresh=True)  # the S3 client made now (~1 s under load: longer than the outage below)
    fs.invalidate_cache()
    server.stop()
    restart = threading.Timer(1.2, server.start)  # down ~1 s: the first listings fail, a later one answers
    restart.start()
    try:
        with caplog.at_level(logging.WARNING, logger="scaletrain"):
            shards = list_shards(src, 0, fs)
    finally:
        restart.join()
    assert f"listing s3://{BUCKET}/a/ failed (EndpointConnectionError" in caplog.text  # a listing did fail
    assert [s.url for s in shards] == [f"s3://{BUCKET}/a/part-{k}.jsonl" for k in range(4)]


def test_the_endpoint_comes_from_the_environment_or_the_source(s3, monkeypatch, tmp_path: Path):
    server, _ = s3
    assert len(list_shards(SourceConfig(path=f"s3://{BUCKET}/a/"), 0)) == 4  # AWS_ENDPOINT_URL
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # not used: the source names its own
    src = SourceConfig(path=f"s3://{BUCKET}/b/*.jsonl", endpoint_url=server.url)
    assert [s.url for s in list_shards(src, 0)] == [f"s3://{BUCKET}/b/part-{k}.jsonl" for k in range(4)]


def test_a_source_that_cannot_be_listed_is_refused_before_launch(s3, tmp_path: Path, monkeypatch, caplog):
    monkeypatch.setattr(storage, "_BACKOFF_S", 0.01)  # 6 tries of a dead endpoint: 0.31 s, not 15.5
    t = time.monotonic()
    paths = [f"s3://{BUCKET}/a/", "s3://no-such-bucket/x/", f"s3://{BUCKET}/b/", f"s3://{BUCKET}/a/"]
    cfg = data_cfg(paths, tmp_path)
    cfg.sources[2].endpoint_url = "http://127.0.0.1:9"  # nothing listens there
    cfg.sources[3].profile = "no-such-profile"  # the source's profile is what botocore looks up
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        problems = data_problems(cfg)
    assert len(problems) == 3, problems
    assert "data.sources[1].path s3://no-such-bucket/x/ does not exist" in problems[0]
    assert problems[1].startswith(
        f"data.sources[2].path s3://{BUCKET}/b/ cannot be listed (asked 6 times over 0.31 s): EndpointConnectionError"
    )
    assert problems[2].startswith(f"data.sources[3].path s3://{BUCKET}/a/ cannot be listed: ProfileNotFound")
    assert time.monotonic() - t < 10  # our backoff only, not botocore's retries under each attempt
    # Asked again: only the endpoint that does not answer; a missing bucket or profile is an answer.
    retried = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
    assert len(retried) == 5, retried
    assert all(m.startswith(f"listing s3://{BUCKET}/b/ failed") for m in retried), retried


def test_the_cache_stays_within_its_bound(s3, tmp_path: Path):
    _, local = s3
    reference = run_steps(loader(data_cfg([str(local / "a")], tmp_path)), 12)
    ld = loader(data_cfg([f"s3://{BUCKET}/a/"], tmp_path, stream_cache_mb=0, read_ahead=1))
    assert run_steps(ld, 12) == reference  # 4 shards, each fetched, read and dropped in turn
    ld.close()
    cached = list((tmp_path / "c" / "stream").iterdir())
    assert ld.streams[0].cache.fetched >= 4 and len(cached) <= 2, cached  # the one fetched ahead, at most
