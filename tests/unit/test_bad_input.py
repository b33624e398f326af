"""Bad input that used to end in a traceback or in silent garbage (issue 10 item 9): binary and non-UTF-8 text
sources, parquet columns that are not text, Hugging Face directories our model would compute differently, and a
full disk under the run records. Each ends in a message that says what to change, and loses nothing written.

(A model.vocab_size below the tokenizer's is refused by validate: tests/unit/test_config.py::
test_the_model_is_checked_as_resolved_from_its_preset.)"""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from scaletrain.checkpoint.convert import from_hf
from scaletrain.checkpoint.hf.core import hf_dir_problems
from scaletrain.checkpoint.hf.sharded import load_hf_weights
from scaletrain.config import DataConfig, ModelConfig, SourceConfig
from scaletrain.config.io import read_toml
from scaletrain.data.prepare import prepare_data
from scaletrain.data.sources import Skipped, read_documents
from scaletrain.data.tokenizer import ByteTokenizer
from scaletrain.errors import UserError
from scaletrain.metrics.writer import MetricsWriter, append_event, dropped_lines
from scaletrain.models import build_model, resolve_model_args

# A real PNG header: its NUL bytes are what marks a file as binary.
PNG = (
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00\x00\x1f\x15\xc4\x89"
)
QUIET = lambda s: None  # noqa: E731


def _prepare(data: Path, cache: Path, workers: int = 1, **kw) -> tuple[Path, dict]:
    cfg = DataConfig(sources=[SourceConfig(path=str(data), **kw)], cache_dir=str(cache), workers=workers)
    [(d, _)] = prepare_data(cfg, ByteTokenizer(), log=QUIET)
    index = json.loads((d / "index.json").read_text())
    return d, index


def _tokens(d: Path, index: dict) -> list[int]:
    return np.fromfile(d / index["shards"][0]["file"], dtype=np.uint16).tolist()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# -- 2. Binary and non-UTF-8 files in text and jsonl sources -------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
def test_binary_and_non_utf8_text_files_are_left_out_and_named(tmp_path, caplog, workers):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a_good.txt").write_text("héllo")
    (data / "b_image.png").write_bytes(PNG)
    (data / "c_latin1.txt").write_bytes("café au lait".encode("latin-1"))  # one bad byte in ASCII text
    (data / "d_utf16.txt").write_bytes("hello".encode("utf-16"))
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        d, index = _prepare(data, tmp_path / "c", workers=workers)
    # Only the UTF-8 file is tokenised: no replacement characters, no PNG bytes.
    assert _tokens(d, index) == [*"héllo".encode(), 256]
    assert index["num_documents"] == 1
    (msg,) = _warnings(caplog)
    assert "data.sources[0]: left out 3 file(s) that are not UTF-8 text" in msg
    assert f"{data / 'b_image.png'} (binary: a NUL byte at offset 8)" in msg
    assert f"{data / 'c_latin1.txt'} (invalid UTF-8 at offset 3)" in msg
    assert f"{data / 'd_utf16.txt'} (UTF-16 text" in msg
    assert "iconv" in msg
    # What was left out is kept with the prepared data, so a cache hit still says so.
    assert index["skipped"]["files"] == 3
    logs: list[str] = []
    prepare_data(
        DataConfig(sources=[SourceConfig(path=str(data))], cache_dir=str(tmp_path / "c")),
        ByteTokenizer(),
        log=logs.append,
    )
    assert "cache hit" in logs[-1] and "3 file(s) that are not UTF-8 text were left out" in logs[-1]


def test_undecodable_jsonl_lines_are_left_out_and_counted(tmp_path, caplog):
    p = tmp_path / "a.jsonl"
    p.write_bytes(b'{"text": "one"}\n{"text": "caf\xe9"}\n{"text": "two"}\n')
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        d, index = _prepare(p, tmp_path / "c")
    assert _tokens(d, index) == [*b"one", 256, *b"two", 256]
    (msg,) = _warnings(caplog)
    assert f"left out 1 line(s) that are not UTF-8 text: {p}:2 (invalid UTF-8 at offset 13)" in msg


def test_a_binary_jsonl_file_is_left_out_not_parsed(tmp_path):
    (tmp_path / "good.jsonl").write_text('{"text": "ok"}\n')
    (tmp_path / "bad.jsonl").write_bytes(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03")  # a gzip header
    d, index = _prepare(tmp_path, tmp_path.parent / "cache-jsonl")
    assert _tokens(d, index) == [*b"ok", 256]
    assert index["skipped"] == {
        "files": 1,
        "lines": 0,
        "examples": [f"{tmp_path / 'bad.jsonl'} (binary: a NUL byte at offset 3)"],
    }


def test_a_source_with_nothing_decodable_is_refused_and_nothing_is_kept(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "x.png").write_bytes(PNG)
    (data / "y.txt").write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(UserError) as e:
        _prepare(data, tmp_path / "c")
    msg = str(e.value)
    assert "data.sources[0]: nothing to train on: all 2 file(s) are not UTF-8 text" in msg
    assert str(data / "x.png") in msg and str(data / "y.txt") in msg
    assert "point data.sources[0].path at UTF-8 text" in msg
    assert list((tmp_path / "c" / "shards").iterdir()) == []  # no half-made (or empty) prepared directory


def test_read_documents_refuses_undecodable_text_unless_asked_to_skip(tmp_path):
    p = tmp_path / "a.txt"
    p.write_bytes(b"line one\n\xff")
    with pytest.raises(UserError, match=r"a.txt is not UTF-8 text \(invalid UTF-8 at offset 9\)"):
        list(read_documents(p, "text", "text", index=2))
    skipped = Skipped()
    assert list(read_documents(p, "text", "text", index=2, skipped=skipped)) == []
    assert (skipped.files, skipped.lines) == (1, 0)


# -- 3. Parquet columns that do not hold strings --------------------------------------------------------------------


@pytest.mark.parametrize(
    "column, arrow_type",
    [
        (pa.array([1, 2], pa.int64()), "int64"),
        (pa.array([b"a", b"b"], pa.binary()), "binary"),
        (pa.array([["a"], ["b"]], pa.list_(pa.string())), "list<element: string>"),
    ],
    ids=["int64", "binary", "list"],
)
def test_parquet_column_that_is_not_text_is_refused_with_its_type(tmp_path, column, arrow_type):
    p = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": column, "body": ["x", "y"], "n": [1, 2]}), p)
    with pytest.raises(UserError) as e:
        list(read_documents(p, "parquet", "text", index=1))
    msg = str(e.value)
    assert f"{p}: column 'text' holds {arrow_type}, not strings" in msg
    assert "set data.sources[1].field to a string column (here: 'body')" in msg


def test_parquet_text_in_any_string_type_is_read(tmp_path):
    p = tmp_path / "a.parquet"
    table = pa.table(
        {
            "large": pa.array(["a", "b"], pa.large_string()),
            "dict": pa.array(["c", "d"]).dictionary_encode(),
        }
    )
    pq.write_table(table, p)
    assert list(read_documents(p, "parquet", "large")) == ["a", "b"]
    assert list(read_documents(p, "parquet", "dict")) == ["c", "d"]


# -- 4. Hugging Face directories our model would compute differently -----------------------------------------------


def _hf_dir(path: Path, layers: int = 2, **config) -> Path:
    """A tiny Llama saved by transformers itself (config.json in its current format, safetensors weights)."""
    transformers = pytest.importorskip("transformers")
    cfg = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**cfg, **config})).save_pretrained(str(path))
    return path


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))


def _import(hf: Path, out: Path) -> torch.nn.Module:
    """`scaletrain convert --from hf`, then the model that config builds with the HF weights loaded."""
    from_hf(hf, out)
    fields = read_toml(str(out))["model"]
    fields.pop("init_from")
    args = resolve_model_args(ModelConfig(**fields), None, 32)
    model = build_model(args, seed=0, device="cpu")
    load_hf_weights(model, hf)
    return model.eval()


def _logits_diff(hf_dir: Path, model: torch.nn.Module) -> float:
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir)).eval()
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (hf(x).logits - model(x)).abs().max().item()


def test_hf_rope_is_read_from_either_config_format_and_matches_transformers(tmp_path):
    # transformers >= 5 writes rope_theta inside rope_parameters; reading only the old top-level key silently
    # trained with RoPE base 10000 instead.
    hf = _hf_dir(
        tmp_path / "hf",
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    model = _import(hf, tmp_path / "a.toml")
    a = model.args
    assert (a.rope_theta, a.rope_scaling, a.rope_scaling_factor, a.rope_original_max_len) == (
        500000.0,
        "llama3",
        8.0,
        16,
    )
    assert _logits_diff(hf, model) < 1e-5
    # The same fields in the transformers 4 layout (what our export writes).
    cfg = json.loads((hf / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
    (hf / "config.json").write_text(json.dumps(cfg))
    assert _import(hf, tmp_path / "b.toml").args == a


@pytest.mark.parametrize(
    "rope, field",
    [
        ({"high_freq_factor": 2.0}, "rope_parameters.high_freq_factor 2.0"),
        ({"low_freq_factor": 2.0}, "rope_parameters.low_freq_factor 2.0"),
        ({"rope_type": "yarn"}, "rope_parameters.rope_type 'yarn'"),
        ({"rope_type": "linear"}, "rope_parameters.rope_type 'linear'"),
    ],
    ids=["high_freq_factor", "low_freq_factor", "yarn", "linear"],
)
def test_hf_rope_our_model_does_not_compute_is_refused(tmp_path, rope, field):
    hf = _hf_dir(tmp_path / "hf")
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    _edit_config(hf, rope_parameters={**llama3, **rope})
    out = tmp_path / "c.toml"
    with pytest.raises(UserError) as e:
        from_hf(hf, out)
    assert f"config.json: {field}" in str(e.value)
    assert "our model computes RoPE" in str(e.value)
    assert not out.exists()  # nothing written for a refused directory


@pytest.mark.parametrize("flag", ["attention_bias", "mlp_bias"])
def test_hf_biases_are_refused_naming_the_field_and_tensors(tmp_path, flag):
    hf = _hf_dir(tmp_path / "hf", **{flag: True})
    out = tmp_path / "c.toml"
    with pytest.raises(UserError) as e:
        from_hf(hf, out)
    msg = str(e.value)
    assert f"config.json: {flag} is true" in msg and "our Llama has no biases" in msg
    tensor = "self_attn.q_proj.bias" if flag == "attention_bias" else "mlp.gate_proj.bias"
    assert f"model.layers.0.{tensor}" in msg
    assert not out.exists()


def test_hf_bias_tensors_are_refused_even_when_config_json_says_none(tmp_path):
    hf = _hf_dir(tmp_path / "hf")
    model = _import(hf, tmp_path / "a.toml")  # loads while the directory is clean
    weights = load_file(str(hf / "model.safetensors"))
    weights["model.layers.1.self_attn.o_proj.bias"] = torch.zeros(16)
    save_file(weights, str(hf / "model.safetensors"))
    for check in (lambda: from_hf(hf, tmp_path / "b.toml"), lambda: load_hf_weights(model, hf)):
        with pytest.raises(UserError, match=r"bias tensor\(s\) .*model.layers.1.self_attn.o_proj.bias"):
            check()


def test_hf_extra_layers_and_unknown_tensors_are_refused(tmp_path):
    hf = _hf_dir(tmp_path / "hf", layers=3)
    # config.json and the weights disagree: layer 2 would have been dropped without a word.
    _edit_config(hf, num_hidden_layers=2)
    weights = load_file(str(hf / "model.safetensors"))
    weights["score.weight"] = torch.zeros(2, 16)  # a classification head: not a causal-LM weight
    save_file(weights, str(hf / "model.safetensors"))
    problems = hf_dir_problems(hf)
    assert any(
        "tensor(s) of layer 2, beyond config.json's num_hidden_layers 2" in p
        and "model.layers.2.input_layernorm.weight" in p
        for p in problems
    ), problems
    assert any("unexpected tensor(s) 'score.weight'" in p for p in problems), problems
    with pytest.raises(UserError):
        from_hf(hf, tmp_path / "c.toml")


def test_hf_init_into_a_model_with_fewer_layers_is_refused(tmp_path):
    # model.init_from with model.n_layers 1 would have loaded layer 0 and dropped layer 1 without a word.
    hf = _hf_dir(tmp_path / "hf")
    from_hf(hf, tmp_path / "a.toml")
    fields = read_toml(str(tmp_path / "a.toml"))["model"]
    fields.pop("init_from")
    model = build_model(resolve_model_args(ModelConfig(**{**fields, "n_layers": 1}), None, 32), 0, "cpu")
    with pytest.raises(UserError) as e:
        load_hf_weights(model, hf)
    assert "model.layers.1.mlp.down_proj.weight" in str(e.value) and "model.n_layers" in str(e.value)


def test_hf_init_with_other_rope_than_config_json_is_refused(tmp_path):
    # The 8B preset computes Llama 3.1 RoPE scaling; Llama 3 (no scaling) weights loaded into it would run with the
    # wrong frequencies and train on.
    hf = _hf_dir(tmp_path / "hf", rope_theta=500000.0)
    from_hf(hf, tmp_path / "a.toml")
    fields = read_toml(str(tmp_path / "a.toml"))["model"]
    fields.pop("init_from")
    fields.update(rope_scaling="llama3", rope_theta=10000.0)
    model = build_model(resolve_model_args(ModelConfig(**fields), None, 32), 0, "cpu")
    with pytest.raises(UserError) as e:
        load_hf_weights(model, hf)
    msg = str(e.value)
    assert "model.rope_theta is 10000.0 but config.json has 500000.0" in msg
    assert "model.rope_scaling is 'llama3' but config.json has 'none'" in msg


# -- 5. A full disk under metrics.jsonl and events.jsonl ------------------------------------------------------------


def _fail_writes_to(monkeypatch: pytest.MonkeyPatch, path: Path, short: bool = False) -> None:
    """Make write(2) on `path` fail as on a full disk: raise ENOSPC, or (`short`) write half the bytes and return
    that count, which is what the kernel does when the disk fills in the middle of a write. Other files write on."""
    real_write = os.write

    def write(fd: int, data: bytes) -> int:
        try:
            target = os.path.exists(path) and os.path.samestat(os.fstat(fd), os.stat(path))
        except OSError:
            target = False
        if not target:
            return real_write(fd, data)
        if short:
            return real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", write)


def _lines(path: Path) -> list[dict]:
    # Strict: every line must parse, as parity and the tests' readers require.
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("short", [False, True], ids=["enospc", "short_write"])
def test_full_disk_drops_metrics_lines_warns_once_and_training_goes_on(tmp_path, monkeypatch, caplog, short):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(tmp_path, enabled=True, tensorboard=False)
    writer.log(1, {"loss": 3.0})
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        with monkeypatch.context() as m:
            _fail_writes_to(m, path, short=short)
            writer.log(2, {"loss": 2.0})  # must not raise: the run goes on
            writer.log(3, {"loss": 1.5})
        (first,) = _warnings(caplog)
        assert str(path) in first and "dropped" in first
        if not short:
            assert "No space left on device" in first
        writer.log(4, {"loss": 1.0})  # space again: lines land whole after the earlier ones
        writer.close()
    assert [r["step"] for r in _lines(path)] == [1, 4]
    assert dropped_lines(path) == 2 and writer.dropped == {"metrics.jsonl": 2}
    assert any("2 line(s)" in w and str(path) in w for w in _warnings(caplog)[1:])


@pytest.mark.parametrize("short", [False, True], ids=["enospc", "short_write"])
def test_full_disk_drops_events_without_breaking_the_file(tmp_path, monkeypatch, caplog, short):
    path = tmp_path / "events.jsonl"
    append_event(tmp_path, "start", 0)
    with caplog.at_level(logging.WARNING, logger="scaletrain"), monkeypatch.context() as m:
        _fail_writes_to(m, path, short=short)
        append_event(tmp_path, "checkpoint", 5, path="x")
        append_event(tmp_path, "checkpoint", 10, path="y")
    assert len(_warnings(caplog)) == 1
    append_event(tmp_path, "end", 12)
    assert [(e["kind"], e["step"]) for e in _lines(path)] == [("start", 0), ("end", 12)]
    assert dropped_lines(path) == 2


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_real_enospc_from_the_kernel_is_survived(tmp_path, caplog):
    # /dev/full answers every write with ENOSPC: the failure comes from the kernel, nothing of ours is patched.
    (tmp_path / "events.jsonl").symlink_to("/dev/full")
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        append_event(tmp_path, "start", 0)
    (msg,) = _warnings(caplog)
    assert "events.jsonl" in msg and "No space left on device" in msg


def test_a_full_disk_under_tensorboard_turns_it_off_and_metrics_go_on(tmp_path, monkeypatch, caplog):
    from torch.utils.tensorboard import SummaryWriter

    def add_scalar(self, *args, **kwargs):
        # Where tensorboard's writer thread re-raises the failed write of an earlier event in our thread.
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(SummaryWriter, "add_scalar", add_scalar)
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        with MetricsWriter(tmp_path, enabled=True, tensorboard=True) as writer:
            writer.log(1, {"loss": 2.0})
            writer.log(2, {"loss": 1.0})
    (msg,) = _warnings(caplog)
    assert "TensorBoard is off" in msg and "No space left on device" in msg
    assert [r["step"] for r in _lines(tmp_path / "metrics.jsonl")] == [1, 2]
