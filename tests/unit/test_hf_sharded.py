"""load_hf_sharded on one process (issue 23 item 3): a multi-file Llama or Mixtral checkpoint (both Mixtral tensor
layouts) loads bit for bit as load_hf_weights loads it, with transformers' logits; what does not fit is refused with
the tensor or field named. The layouts over several ranks are in tests/distributed/test_hf_sharded.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from scaletrain.checkpoint.hf.core import args_from_hf_config
from scaletrain.checkpoint.hf.sharded import load_hf_sharded, load_hf_weights
from scaletrain.errors import ConfigError, UserError
from scaletrain.models import ModelArgs, build_model

transformers = pytest.importorskip("transformers")

HF = dict(
    vocab_size=70,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)


def _save(kind: str, path: Path) -> Path:
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=48, **HF))
    else:
        cfg = transformers.MixtralConfig(
            intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, **HF
        )
        model = transformers.MixtralForCausalLM(cfg)
        with torch.no_grad():  # a decisive router: no near-ties for rounding to flip (test_hf_mixtral.py)
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0.0, 1.0)
    model.save_pretrained(str(path), max_shard_size="20KB", save_original_format=kind != "mixtral_fused")
    assert len(list(path.glob("*.safetensors"))) > 2
    fused = "gate_up_proj" in (path / "model.safetensors.index.json").read_text()
    assert fused == (kind == "mixtral_fused")
    return path


def _args(path: Path, **changes) -> ModelArgs:
    fields = args_from_hf_config(json.loads((path / "config.json").read_text()))
    return dataclasses.replace(ModelArgs(**fields, max_seq_len=16), **changes)


@pytest.mark.parametrize("kind", ["llama", "mixtral", "mixtral_fused"])
def test_a_multi_file_checkpoint_loads_as_the_whole_load_with_transformers_logits(tmp_path, kind):
    path = _save(kind, tmp_path / kind)
    args = _args(path)
    whole, sharded = build_model(args, 0, "cpu"), build_model(args, 1, "cpu")
    load_hf_weights(whole, path)
    read = load_hf_sharded([sharded], path, args)
    expected = whole.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in sharded.state_dict().items())
    assert (
        read >= sum(f.stat().st_size for f in path.glob("*.safetensors")) * 0.95
    )  # one process reads it all
    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.MixtralForCausalLM
    x = torch.randint(0, HF["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf = cls.from_pretrained(str(path), dtype=torch.float32).eval()(x).logits
        assert (hf - sharded.eval()(x)).abs().max() <= 1e-5


def test_a_missing_tensor_a_wrong_shape_and_another_config_are_refused(tmp_path):
    path = _save("llama", tmp_path / "llama")
    args = _args(path)
    with pytest.raises(ConfigError, match="model.rope_theta is 500000.0 but config.json has 10000.0"):
        other = dataclasses.replace(args, rope_theta=5e5)
        load_hf_sharded([build_model(other, 0, "cpu")], path, other)
    with pytest.raises(
        UserError, match=r"layers.0.feed_forward.w1.weight: shape \(48, 32\) in the checkpoint"
    ):
        wider = dataclasses.replace(args, ffn_hidden=64)
        load_hf_sharded([build_model(wider, 0, "cpu")], path, wider)
    # Drop one tensor from the file (and the index) that holds it.
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.up_proj.weight"
    f = path / index["weight_map"].pop(name)
    rest = {k: v for k, v in load_file(str(f)).items() if k != name}
    save_file(rest, str(f), metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match=f"lacks {name}"):
        load_hf_sharded([build_model(args, 0, "cpu")], path, args)
