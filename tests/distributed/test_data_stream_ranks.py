"""data.streaming on 2 gloo ranks that split the reading (issue 37: "each worker reads only its shards"), against
moto's S3 server on loopback. What each rank fetched is what the server served it: a WSGI layer around moto's app
records every object GET with the access key that signed it (each rank signs with its own), outside our code.

Each rank fetches only the shards under its own samples (about half of those the batches pass), together they fetch
every one, and the samples and the position are the single rank's; a 2-rank position continues on 1 rank; a dry
source (when_dry = "stop") ends both ranks at the same step as one rank."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from scaletrain.data.counts import INDEX_NAME
from scaletrain.data.streaming import SourceDry, build_streaming_loader
from scaletrain.data.tokenizer import ByteTokenizer
from tests.distributed.spawn import spawn_gathered
from tests.helpers import free_port
from tests.unit.test_data_streaming import SEQ, data_cfg, rows, run_steps

pytest.importorskip("s3fs")
# moto is imported by the fixture, not here: the ranks import this module for _rank, and need no S3 server.
if importlib.util.find_spec("moto") is None:
    pytest.skip("moto is not installed", allow_module_level=True)

# Not test_data_stream_s3's bucket: moto's buckets are one per process, kept between modules.
BUCKET = "ranks"
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
SHARDS, DOCS, BATCH, STEPS = 40, 3, 32, 2  # ~18 tokens a shard, ~14 shards a source a step
EOD = 256
_KEY = re.compile(r"Credential=([^/]+)/")


# One ASCII letter a shard (one byte, one token), none that JSON escapes: every token but end-of-document names the
# source and shard it came from.
LETTERS = [c for c in map(chr, range(0x21, 0x7F)) if c not in '"\\']


def path_of(token: int) -> str:
    source, shard = divmod(LETTERS.index(chr(token)), SHARDS)
    return f"/{BUCKET}/{'ab'[source]}/part-{shard:02d}.jsonl"


def write_corpus(root: Path) -> list[Path]:
    dirs = []
    for i, name in enumerate("ab"):
        d = root / name
        d.mkdir(parents=True)
        for k in range(SHARDS):
            docs = [LETTERS[i * SHARDS + k] * (3 + (k + n) % 5) for n in range(DOCS)]
            (d / f"part-{k:02d}.jsonl").write_text("".join(f'{{"text": "{t}"}}\n' for t in docs))
        dirs.append(d)
    return dirs


class ServedS3:
    """moto's S3 app served on loopback through a layer that records (access key, object path) of each GET."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.served: list[tuple[str, str]] = []

    def start(self) -> None:
        from moto.moto_server import werkzeug_app as moto_app
        from werkzeug.serving import make_server

        app = moto_app.DomainDispatcherApplication(moto_app.create_backend_app)

        def recording(environ, start_response):
            key = _KEY.search(environ.get("HTTP_AUTHORIZATION", ""))
            if environ["REQUEST_METHOD"] == "GET" and environ["PATH_INFO"].endswith(".jsonl"):
                self.served.append((key.group(1) if key else "", environ["PATH_INFO"]))
            return app(environ, start_response)

        self._server = make_server("127.0.0.1", self.port, recording, threaded=True,
                                   request_handler=moto_app.MotoRequestHandler)  # fmt: skip
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()

    def fetched(self, key: str) -> set[str]:
        return {path for k, path in self.served if k == key}


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    from tests.unit.test_data_stream_s3 import serving  # here: the ranks import this module and need no moto

    server, local = ServedS3(), tmp_path_factory.mktemp("corpus")
    with serving(server, BUCKET, write_corpus(local)):
        yield server, local


def _cfg(tmp: Path, **kw):
    # read_ahead = 0: no shard of a later step is fetched, so what a rank fetched is what these steps needed.
    return data_cfg([f"s3://{BUCKET}/a/", f"s3://{BUCKET}/b/"], tmp, read_ahead=0, **kw)


def _loader(cfg, rank: int, ranks: int, group=None, batch: int = BATCH):
    return build_streaming_loader(
        cfg, ByteTokenizer(), batch, rank, ranks, 1234, 100 * SEQ, lambda s: None, group
    )


def _rank(rank: int, world: int, url: str, tmp: str, dry: str) -> dict:
    """One rank: its own access key and cache directory; the loader splits the reading over a gloo group."""
    os.environ.update(AWS_ENV, AWS_ACCESS_KEY_ID=f"rank{rank}", AWS_ENDPOINT_URL=url)
    group = dist.new_group(backend="gloo")
    ld = _loader(_cfg(Path(tmp) / f"rank{rank}"), rank, world, group)
    steps = [rows(*ld.next_batch()) for _ in range(STEPS)]
    state = ld.state_dict()
    ld.close()
    # A rollback past bad samples (resilience.guard) asks for one sample more than the position holds: fewer than
    # the ranks (a loader of its own, with a key of its own: what it fetches is not counted above).
    os.environ["AWS_ACCESS_KEY_ID"] = f"rollback{rank}"
    again = _loader(_cfg(Path(tmp) / f"rank{rank}"), rank, world, group)
    for _ in range(STEPS):
        again.next_batch()
    again.load_state_dict({**again.state_dict(), "next_sample": BATCH * STEPS + 1})
    rollback = rows(*again.next_batch())
    again.close()
    # A local source that runs dry: every rank stops at the same step.
    stop = _loader(data_cfg([dry], Path(tmp) / f"dry{rank}", when_dry="stop"), rank, world, group, batch=4)
    dry_at = next(n for n in range(100) if _raises_dry(stop))
    return {"steps": steps, "state": state, "rollback": rollback, "dry_at": dry_at}


def _raises_dry(ld) -> bool:
    try:
        ld.next_batch()
    except SourceDry:
        return True
    return False


def needed_shards(samples: list[list[int]], ranks: int) -> list[set[str]]:
    """The object paths under each rank's samples of one global batch (contiguous slices), read off the tokens: a
    token names its shard by its letter; an end-of-document belongs to the shard of the letter before it."""
    out: list[set[str]] = [set() for _ in range(ranks)]
    last: dict[str, str] = {}  # source -> the shard of its last letter seen (samples overlap by one token)
    for j, sample in enumerate(samples):
        source = path_of(next(t for t in sample if t != EOD)).split("/")[2]
        here = set()
        for t in sample:
            if t != EOD:
                last[source] = path_of(t)
            if source in last:
                here.add(last[source])
        out[j * ranks // len(samples)] |= here
    return out


def test_each_rank_fetches_only_the_shards_under_its_samples(s3, tmp_path: Path):
    server, local = s3
    os.environ["AWS_ACCESS_KEY_ID"] = "single"
    one = _loader(_cfg(tmp_path / "single"), 0, 1)
    reference = [rows(*one.next_batch()) for _ in range(2 * STEPS)]
    one.close()
    dry = tmp_path / "dry"
    dry.mkdir()
    for k in range(3):  # ~100 tokens: the run stops in its 2nd step of 4 samples of 16
        (dry / f"d{k}.jsonl").write_text("".join(f'{{"text": "{"xyz"[k] * (4 + n)}"}}\n' for n in range(5)))
    single_dry = _loader(data_cfg([str(dry)], tmp_path / "dry1", when_dry="stop"), 0, 1, batch=4)
    single_dry_at = next(n for n in range(100) if _raises_dry(single_dry))
    os.environ["AWS_ACCESS_KEY_ID"] = AWS_ENV["AWS_ACCESS_KEY_ID"]

    ranks = spawn_gathered(_rank, 2, str(tmp_path / "out.json"), server.url, str(tmp_path), str(dry))
    # The samples of each step are the single rank's, rank 0's slice then rank 1's; the position is the same.
    assert [r0 + r1 for r0, r1 in zip(ranks[0]["steps"], ranks[1]["steps"])] == reference[:STEPS]
    assert ranks[0]["state"] == ranks[1]["state"]
    assert [r["dry_at"] for r in ranks] == [single_dry_at] * 2  # a dry source: both ranks stop at once

    needed = [set(), set()]  # the shards under each rank's samples of the steps run
    for step in reference[:STEPS]:
        for r, paths in enumerate(needed_shards(step, 2)):
            needed[r] |= paths
    everything = needed[0] | needed[1]
    later = [set(), set()]  # and of the step after (whose first shards a rank may count early)
    for r, paths in enumerate(needed_shards(reference[STEPS], 2)):
        later[r] |= paths
    # One rank fetches every shard its steps pass, and no other: what needed_shards reads off the tokens.
    assert server.fetched("single") == set().union(*(p for step in reference for p in needed_shards(step, 1)))
    for r in range(2):
        got = server.fetched(f"rank{r}")
        # The shards under its samples (their tokens are in its samples: checked above), and only those, but for
        # those of its next step counted early and a shard or two a step whose size put it under its samples.
        assert needed[r] <= got
        assert len(got - needed[r] - later[r]) <= STEPS, sorted(got - needed[r] - later[r])
        # About half of the shards the steps pass, not all.
        assert len(got & everything) <= 0.65 * len(everything), (len(got & everything), len(everything))
    assert server.fetched("rank0") | server.fetched("rank1") >= everything

    # The counts went to the group's index: a later start that finds it counts nothing again, so rank 1 of 2 fetches
    # exactly the shards under its samples (here without a group: every count it needs is on disk), and each source's
    # first shard, which a loader without a group reads as it starts.
    index = tmp_path / "rank0" / "c" / INDEX_NAME
    assert len(index.read_text().splitlines()) >= len(everything)
    (tmp_path / "again" / "c").mkdir(parents=True)
    shutil.copy(index, tmp_path / "again" / "c" / INDEX_NAME)
    os.environ["AWS_ACCESS_KEY_ID"] = "again"
    again = _loader(_cfg(tmp_path / "again"), 1, 2)
    assert [rows(*again.next_batch()) for _ in range(STEPS)] == ranks[1]["steps"]
    firsts = {path_of(reference[0][0][0]), path_of(reference[0][1][0])}  # the first samples of a and b
    assert server.fetched("again") == needed[1] | firsts
    # Passed over one sample on 2 ranks, the next batch is the one one rank reads.
    single = _loader(_cfg(tmp_path / "rollback"), 0, 1)
    for _ in range(STEPS):
        single.next_batch()
    single.load_state_dict({**single.state_dict(), "next_sample": BATCH * STEPS + 1})
    assert ranks[0]["rollback"] + ranks[1]["rollback"] == rows(*single.next_batch())
    # A position saved on 2 ranks continues on 1.
    os.environ["AWS_ACCESS_KEY_ID"] = AWS_ENV["AWS_ACCESS_KEY_ID"]
    resumed = _loader(_cfg(tmp_path / "resumed"), 0, 1)
    resumed.load_state_dict(ranks[0]["state"])
    assert run_steps(resumed, STEPS) == [r for step in reference[STEPS:] for r in step]
