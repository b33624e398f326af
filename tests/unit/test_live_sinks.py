"""Metrics and events beyond the JSON lines: TensorBoard gets every metric and every event, Weights & Biases (when
installed and metrics.wandb_project is set) the same, checked here in W&B's offline mode; without wandb the
config is refused before launch."""

import importlib.util
import json
import struct
from pathlib import Path

import pytest

from scaletrain.errors import ConfigError
from scaletrain.metrics import MetricsWriter
from scaletrain.validate import load_config
from tests.helpers import DEBUG


def _write_a_short_run(writer: MetricsWriter) -> None:
    writer.event("start", step=0, resumed=False)
    writer.event("eval", step=0, val_loss=5.5, val_ppl=244.7, duration_s=0.01)
    writer.log(1, {"loss": 4.0, "lr": 1e-3, "mfu": 0.2})
    writer.log(2, {"loss": 3.0, "lr": 2e-3, "mfu": 0.3, "val_loss": 3.5, "val_ppl": 33.1})
    writer.event("checkpoint_saved", step=2, path="ckpt/step-2", blocking_s=0.25)
    writer.event("end", step=2, final_loss=3.0, goodput=0.5)


def test_tensorboard_gets_every_metric_validation_and_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(tmp_path, enabled=True, tensorboard=True) as writer:
        _write_a_short_run(writer)
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()

    def scalars(tag: str) -> list[tuple[int, float]]:
        return [(e.step, pytest.approx(e.value)) for e in acc.Scalars(tag)]

    assert scalars("loss") == [(1, 4.0), (2, 3.0)]
    assert scalars("val_loss") == [(2, 3.5)] and scalars("mfu") == [(1, 0.2), (2, 0.3)]
    # Events: numeric fields as scalars (the step-0 evaluation, which no metrics record has), text for each kind.
    assert scalars("events/eval/val_loss") == [(0, 5.5)]
    assert scalars("events/checkpoint_saved/blocking_s") == [(2, 0.25)]
    text_tags = acc.Tags()["tensors"]
    assert {
        "events/start/text_summary",
        "events/checkpoint_saved/text_summary",
        "events/end/text_summary",
    } <= set(text_tags)
    (saved,) = acc.Tensors("events/checkpoint_saved/text_summary")
    assert saved.step == 2 and b"path=ckpt/step-2" in saved.tensor_proto.string_val[0]


def _wandb_records(path: Path):
    """The records of a .wandb file, decoded with wandb's own protobuf. The file is a LevelDB-style log: a 7-byte
    header (":W&B", magic, version), then 32 KiB blocks of chunks, each with a 7-byte header (crc32c, length,
    type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, block = 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's trailer
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if n == 0 and kind == 0:  # zero padding up to the next block
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def test_wandb_offline_run_holds_the_metrics_events_config_and_summary(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text("[training]\nsteps = 2\n[optimizer]\nlr = 0.003\n")
    (run_dir / "run_id").write_text("0123456789abcdef0123456789abcdef\n")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    with MetricsWriter(run_dir, enabled=True, tensorboard=False, wandb_project="scaletrain-test") as writer:
        _write_a_short_run(writer)
    assert writer.wandb_project == "scaletrain-test"  # not turned off by a failure on the way
    wandb.teardown()  # finish() returns before W&B's service has flushed the file; its exit waits for that

    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history, summary, run = [], {}, None
    for r in _wandb_records(log):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            history.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            )
        elif kind == "summary":
            summary.update(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.summary.update}
            )
        elif kind == "run":
            run = r.run
    assert run is not None and run.run_id == "0123456789abcdef0123456789abcdef" and run.display_name == "run"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["training"] == {"steps": 2} and config["optimizer"] == {"lr": 0.003}
    metrics = [(h["step"], h["loss"]) for h in history if "loss" in h]
    assert metrics == [(1, 4.0), (2, 3.0)]
    assert [(h["step"], h["val_loss"]) for h in history if "val_loss" in h] == [(2, 3.5)]
    assert [(h["step"], h["events/eval/val_loss"]) for h in history if "events/eval" in h] == [(0, 5.5)]
    assert any(h.get("events/checkpoint_saved") == 1 and h["step"] == 2 for h in history)
    assert summary["final_loss"] == 3.0 and summary["goodput"] == 0.5


def test_wandb_project_without_wandb_is_refused_before_launch(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a)
    )
    with pytest.raises(ConfigError, match="pip install wandb, or unset metrics.wandb_project"):
        load_config(DEBUG, ["--metrics.wandb_project", "p", "--run.dir", str(tmp_path / "run")])
    # Unset (the default), nothing is needed.
    assert load_config(DEBUG, ["--run.dir", str(tmp_path / "run")]).metrics.wandb_project == ""
