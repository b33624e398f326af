"""Streaming Hugging Face export (issue 23 item 4): tensors read one at a time and written straight into safetensors
files of a capped size with transformers' index; the dtype asked; the transformers check says when it is skipped."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from scaletrain.checkpoint.convert import _check_export, parse_size
from scaletrain.checkpoint.hf.core import export_hf, write_hf
from scaletrain.checkpoint.hf.files import INDEX_FILE, hf_tensor_files
from scaletrain.config import ModelConfig
from scaletrain.errors import UserError
from scaletrain.models import build_model, resolve_model_args


def _model() -> torch.nn.Module:
    return build_model(resolve_model_args(ModelConfig(preset="debug"), 300, 32), seed=0, device="cpu")


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for name, f in hf_tensor_files(path).items():
        with safe_open(str(f), framework="pt") as st:
            out[name] = st.get_tensor(name)
    return out


def test_a_sharded_export_holds_the_single_files_tensors_under_its_cap(tmp_path):
    model = _model()
    export_hf(model, tmp_path / "one")
    export_hf(model, tmp_path / "many", max_shard_bytes=150_000)
    files = sorted((tmp_path / "many").glob("*.safetensors"))
    n = len(files)
    assert n > 5 and [f.name for f in files] == [
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    ]
    index = json.loads((tmp_path / "many" / INDEX_FILE).read_text())
    one = load_file(
        str(tmp_path / "one" / "model.safetensors")
    )  # safetensors' own reader: the format is right
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in one.values())
    for f in files:
        data = sum(v.numel() * 4 for v in load_file(str(f)).values())
        assert data <= 150_000 or len(load_file(str(f))) == 1  # a tensor over the cap: a file of its own
    many = _tensors(tmp_path / "many")
    assert many.keys() == one.keys() and all(torch.equal(many[k], one[k]) for k in one)


def test_bf16_export_rounds_each_tensor(tmp_path):
    model = _model()
    export_hf(model, tmp_path / "bf16", dtype="bf16", max_shard_bytes=100_000)
    got = _tensors(tmp_path / "bf16")
    assert {v.dtype for v in got.values()} == {torch.bfloat16}
    assert torch.equal(
        got["model.embed_tokens.weight"], model.tok_embeddings.weight.detach().to(torch.bfloat16)
    )
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(UserError, match="--dtype 'fp16': choose fp32 or bf16"):
        export_hf(model, tmp_path / "fp16", dtype="fp16")


def test_the_export_reads_one_tensor_at_a_time(tmp_path):
    """Each tensor read is dropped (reference counting frees it at once) before the next but one is read: the
    host holds at most two, never the model."""
    model = _model()
    state = model.state_dict()
    alive: list[weakref.ref] = []
    most = 0

    def read(name: str) -> torch.Tensor:
        nonlocal most
        most = max(most, sum(r() is not None for r in alive))
        value = state[name].detach().clone()
        alive.append(weakref.ref(value))
        return value

    write_hf(
        tmp_path / "hf",
        model.args,
        {k: tuple(v.shape) for k, v in state.items()},
        read,
        max_shard_bytes=50_000,
    )
    assert len(alive) == len(state) and most <= 1


def test_the_transformers_check_says_when_the_model_does_not_fit(tmp_path):
    pytest.importorskip("transformers")
    args = _model().args
    msg = _check_export(tmp_path, tmp_path, args, n_params=10**15, dtype="fp32")  # 4 PB: nothing is loaded
    assert msg.startswith("not checked against transformers: the check holds the model twice in fp32")
    assert "GiB available here" in msg


def test_max_shard_size_reads_like_transformers():
    assert (
        parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8 and parse_size("2GiB") == 2 << 30
    )
    assert parse_size("100000") == 100_000 and parse_size("1.5 KB") == 1500
    for bad in ("", "0", "-1GB", "5 parsecs"):
        with pytest.raises(UserError, match="--max-shard-size"):
            parse_size(bad)
