"""Reading a Hugging Face directory's layout (issue 23 item 4): which safetensors file holds each tensor, from
model.safetensors.index.json for a multi-file checkpoint or the files' headers, checked both ways; a multi-file
checkpoint imports as the single file does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from scaletrain.checkpoint.hf.core import export_hf
from scaletrain.checkpoint.hf.files import INDEX_FILE, hf_tensor_files
from scaletrain.checkpoint.hf.sharded import load_hf_weights
from scaletrain.config import ModelConfig
from scaletrain.errors import UserError
from scaletrain.models import build_model, resolve_model_args


def _model(seed: int = 0) -> torch.nn.Module:
    return build_model(resolve_model_args(ModelConfig(preset="debug"), 64, 32), seed=seed, device="cpu")


def _split(one: Path, out: Path, index: bool = True) -> dict[str, str]:
    """`one`'s export rewritten as two safetensors files (with an index when asked)."""
    out.mkdir()
    (out / "config.json").write_text((one / "config.json").read_text())
    sd = load_file(str(one / "model.safetensors"))
    names = sorted(sd)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: sd[n] for n in part}, str(out / file))
    weight_map = {n: f for f, part in halves.items() for n in part}
    if index:
        (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


@pytest.fixture
def exported(tmp_path: Path) -> Path:
    export_hf(_model(), tmp_path / "one")
    return tmp_path / "one"


def test_the_index_says_which_file_holds_each_tensor_and_a_split_checkpoint_imports_as_one(
    exported, tmp_path
):
    weight_map = _split(exported, tmp_path / "two")
    assert {n: f.name for n, f in hf_tensor_files(tmp_path / "two").items()} == weight_map
    # Without an index the headers say the same.
    assert {n: f.name for n, f in hf_tensor_files(exported).items()} == dict.fromkeys(
        weight_map, "model.safetensors"
    )
    a, b = _model(seed=1), _model(seed=2)
    load_hf_weights(a, exported)
    load_hf_weights(b, tmp_path / "two")
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(va, vb), k
    # Both hold the exported (seed 0) weights, not their own seed's.
    assert torch.equal(
        a.state_dict()["layers.0.attention.wq.weight"], _model(0).layers["0"].attention.wq.weight
    )


def test_an_index_that_names_a_missing_file_or_tensor_is_refused(exported, tmp_path):
    weight_map = _split(exported, tmp_path / "two")
    index = tmp_path / "two" / INDEX_FILE
    (tmp_path / "two" / "model-00002-of-00002.safetensors").rename(tmp_path / "two" / "elsewhere.safetensors")
    with pytest.raises(UserError, match="model-00002-of-00002.safetensors, which is not in"):
        hf_tensor_files(tmp_path / "two")
    (tmp_path / "two" / "elsewhere.safetensors").rename(tmp_path / "two" / "model-00002-of-00002.safetensors")
    index.write_text(
        json.dumps({"weight_map": {**weight_map, "model.extra.weight": next(iter(weight_map.values()))}})
    )
    with pytest.raises(UserError, match="names tensor\\(s\\) its files lack: model.extra.weight"):
        hf_tensor_files(tmp_path / "two")
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "../x.safetensors"}}))
    with pytest.raises(UserError, match="not a .safetensors file beside the index"):
        hf_tensor_files(tmp_path / "two")


def test_without_an_index_a_tensor_in_two_files_is_refused(exported, tmp_path):
    _split(exported, tmp_path / "two", index=False)
    sd = load_file(str(exported / "model.safetensors"))
    save_file({"lm_head.weight": sd["lm_head.weight"]}, str(tmp_path / "two" / "extra.safetensors"))
    with pytest.raises(UserError, match="'lm_head.weight' is in both"):
        hf_tensor_files(tmp_path / "two")
