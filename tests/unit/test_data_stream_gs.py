"""data.streaming from gs:// against a real GCS JSON API: gcp-storage-emulator's server started on loopback by this
module, read through gcsfs (fsspec's GCS), not a mock. The same files streamed from gs:// and read locally give the
same samples in the same order, with the endpoint from STORAGE_EMULATOR_HOST or from the source's endpoint_url."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from scaletrain.config import SourceConfig
from scaletrain.data.storage import list_shards
from scaletrain.errors import UserError
from tests.helpers import free_port
from tests.unit.test_data_streaming import data_cfg, loader, run_steps, write_corpus

pytest.importorskip("gcsfs")
emulator = pytest.importorskip("gcp_storage_emulator.server")
from gcsfs.core import GCSFileSystem  # noqa: E402

BUCKET = "corpus"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The emulator's URL, with the corpus of test_data_streaming uploaded under gs://corpus/{a,b}/; and its local
    copy."""
    port = free_port()
    server = emulator.create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    url = f"http://127.0.0.1:{port}"
    local = tmp_path_factory.mktemp("corpus")
    fs = GCSFileSystem(endpoint_url=url, token="anon", skip_instance_cache=True)
    for d in write_corpus(local, shards=4, docs=6):
        for f in sorted(d.iterdir()):
            fs.put_file(str(f), f"{BUCKET}/{d.name}/{f.name}")
    yield url, local
    server.stop()


def test_gs_and_local_files_give_the_same_samples(gcs, tmp_path: Path, monkeypatch):
    url, local = gcs
    reference = run_steps(loader(data_cfg([str(local / "a"), str(local / "b")], tmp_path, weights=[2, 1])), 8)
    paths = [f"gs://{BUCKET}/a/", f"gs://{BUCKET}/b/*.jsonl"]  # a directory and a glob
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)  # the endpoint as Google's tools read it
    streamed = loader(data_cfg(paths, tmp_path / "env", weights=[2, 1]))
    listed = [s.url for s in streamed.streams[1].shards]
    assert listed == [f"gs://{BUCKET}/b/part-{k}.jsonl" for k in range(4)]
    assert run_steps(streamed, 8) == reference  # bit for bit, in the same order
    streamed.close()
    assert streamed.streams[0].cache.fetched >= 4  # fetched from the emulator, not read in place
    # The endpoint set per source instead (the environment's points nowhere), into a cold cache.
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
    cfg = data_cfg(paths, tmp_path / "source", weights=[2, 1])
    for src in cfg.sources:
        src.endpoint_url = url
    assert run_steps(loader(cfg), 8) == reference


def test_a_gs_source_that_does_not_exist_is_refused_with_its_url(gcs):
    url, _ = gcs
    with pytest.raises(UserError, match=f"gs://{BUCKET}/missing/ does not exist"):
        list_shards(SourceConfig(path=f"gs://{BUCKET}/missing/", endpoint_url=url), 0)
