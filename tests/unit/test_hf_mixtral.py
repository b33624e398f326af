"""Hugging Face Mixtral interchange (issue 13 item 5): our MoE exported loads in transformers'
MixtralForCausalLM with the same logits, a Mixtral saved by transformers (either tensor layout) imports with the
same logits, and what Mixtral cannot represent, or a directory that does not hold what its config.json says, is
refused with the field or tensor named."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import fsspec
import pytest
import tomli_w
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from scaletrain.checkpoint.convert import from_hf, to_hf
from scaletrain.checkpoint.hf.core import (
    args_from_hf_config,
    export_hf,
    hf_dir_problems,
    verify_with_transformers,
)
from scaletrain.checkpoint.hf.sharded import load_hf_weights
from scaletrain.checkpoint.integrity import write_commit
from scaletrain.checkpoint.state import ModelState
from scaletrain.config import Config, ModelConfig, MoEConfig
from scaletrain.config.io import read_toml, to_dict
from scaletrain.data import load_tokenizer
from scaletrain.errors import ConfigError, UserError
from scaletrain.models import ModelArgs, build_model, resolve_model_args
from scaletrain.models.moe import MoE

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 24
TINY = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=VOCAB, max_seq_len=32)
MOE = dict(n_experts=4, top_k=2, moe_hidden=24)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _decisive_router(gates: list[torch.Tensor]) -> None:
    # At init std 0.02 the router is nearly uniform, so rounding (1e-7) could flip a near-tie between the two
    # implementations; a wide router makes each token's choice clear and spreads the tokens over all experts.
    with torch.no_grad():
        for g in gates:
            g.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(g.numel()))


def _gates(model: torch.nn.Module) -> list[torch.Tensor]:
    return [
        layer.feed_forward.router.gate.weight
        for layer in model.layers.values()
        if isinstance(layer.feed_forward, MoE)
    ]


def _ours(**changes) -> torch.nn.Module:
    model = build_model(ModelArgs(**{**TINY, **MOE, **changes}), seed=0, device="cpu")
    _decisive_router(_gates(model))
    return model.eval()


def _hf_mixtral(path: Path, fused: bool = False, **config) -> Path:
    """A tiny random Mixtral saved by transformers: the Hub layout (one tensor per expert), or with fused=True
    transformers' in-memory layout (gate_up_proj / down_proj)."""
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        router_aux_loss_coef=0.02,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**cfg, **config}))
    _decisive_router([layer.mlp.gate.weight for layer in model.model.layers])
    model.save_pretrained(str(path), save_original_format=not fused)
    return path


def _import(hf: Path, out: Path) -> torch.nn.Module:
    """`scaletrain convert --from hf`, then the model its config builds with model.init_from's weights loaded."""
    from_hf(hf, out)
    sections = read_toml(str(out))
    fields = {k: v for k, v in sections["model"].items() if k != "init_from"}
    args = resolve_model_args(ModelConfig(**fields), None, 32, moe=MoEConfig(**sections.get("moe", {})))
    model = build_model(args, seed=1, device="cpu")
    load_hf_weights(model, hf)
    return model.eval()


def _hf_logits(path: Path, x: torch.Tensor) -> torch.Tensor:
    hf = transformers.MixtralForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(x).logits


def test_export_loads_in_transformers_mixtral_with_equal_logits(tmp_path):
    model = _ours(rope_theta=5e5, window=8, aux_loss_coef=0.01)
    export_hf(model, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["model_type"] == "mixtral"
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"]) == (4, 2, 24)
    assert (cfg["rope_theta"], cfg["sliding_window"]) == (5e5, 8)
    # The Hub layout, which every Mixtral checkpoint has and transformers loads.
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as st:
        names = set(st.keys())
        w2 = st.get_tensor("model.layers.1.block_sparse_moe.experts.3.w2.weight")
    assert torch.equal(w2, model.layers["1"].feed_forward.experts.w2[3])
    assert {
        f"model.layers.0.block_sparse_moe.experts.{e}.w{w}.weight" for e in range(4) for w in (1, 2, 3)
    } <= names
    assert not any("expert_bias" in n or "mlp." in n for n in names)
    x = _tokens()
    with torch.no_grad():
        ours = model(x)
    assert (_hf_logits(tmp_path / "hf", x) - ours).abs().max().item() <= 1e-5
    # What `scaletrain convert --to hf` reports.
    assert verify_with_transformers(model, tmp_path / "hf") <= 1e-5


@pytest.mark.parametrize("fused", [False, True], ids=["hub_layout", "fused_layout"])
def test_transformers_mixtral_imports_with_equal_logits(tmp_path, fused):
    hf = _hf_mixtral(tmp_path / "hf", fused=fused, sliding_window=8, tie_word_embeddings=fused)
    names = load_file(str(hf / "model.safetensors"))
    assert ("model.layers.0.mlp.experts.gate_up_proj" in names) == fused
    model = _import(hf, tmp_path / "a.toml")
    moe = read_toml(str(tmp_path / "a.toml"))["moe"]
    assert (moe["n_experts"], moe["top_k"], moe["hidden"], moe["every"], moe["router"]) == (
        4,
        2,
        24,
        1,
        "softmax",
    )
    # router_aux_loss_coef 0.02 x top_k 2 / 2 layers: the same balance-loss weight (mixtral.aux_coef_from_hf).
    assert moe["aux_loss_coef"] == pytest.approx(0.02)
    a = model.args
    assert (a.window, a.rope_theta, a.tie_embeddings) == (8, 1e6, fused)
    x = _tokens()
    with torch.no_grad():
        diff = (_hf_logits(hf, x) - model(x)).abs().max().item()
    assert diff <= 1e-5
    # Back out again: the Hub layout, with the same logits.
    export_hf(model, tmp_path / "again")
    assert (_hf_logits(tmp_path / "again", x) - _hf_logits(hf, x)).abs().max().item() <= 1e-5


def test_a_config_json_without_rope_theta_gets_mixtrals_default(tmp_path):
    # MixtralConfig's RoPE base is 1e6, not Llama's 10000: a config.json that names none was trained with 1e6.
    hf = _hf_mixtral(tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    del cfg["rope_parameters"]
    assert args_from_hf_config(cfg)["rope_theta"] == 1e6
    assert transformers.MixtralConfig(**cfg).rope_parameters["rope_theta"] == 1e6


def _with_routing_bias(model: torch.nn.Module) -> torch.nn.Module:
    model.layers["1"].feed_forward.router.expert_bias[2] = 0.5
    return model


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(shared_experts=1), "moe.shared_experts is 1; MixtralForCausalLM has no shared experts"),
        (dict(router="sigmoid"), "moe.router is 'sigmoid'; MixtralForCausalLM routes by a softmax"),
        (
            dict(norm_topk=False),
            "moe.norm_topk is false; MixtralForCausalLM always divides the top-k weights",
        ),
        (dict(moe_every=2), "moe.every is 2; MixtralForCausalLM has an MoE feed-forward on every layer"),
        (dict(first_dense=1), "moe.first_dense is 1; MixtralForCausalLM has no dense layers"),
        (dict(capacity_factor=1.25), "moe.capacity_factor is 1.25; MixtralForCausalLM is dropless"),
        (
            dict(window=8, window_every=2),
            "model.window_every is 2; MixtralForCausalLM's sliding_window applies",
        ),
        ("bias", "routing bias (moe.bias_update_rate balancing) is nonzero in layer(s) 1"),
    ],
    ids=["shared", "sigmoid", "norm_topk", "every", "first_dense", "capacity", "window_every", "expert_bias"],
)
def test_export_refuses_what_mixtral_cannot_represent(tmp_path, changes, message):
    model = _with_routing_bias(_ours()) if changes == "bias" else _ours(**changes)
    with pytest.raises(ConfigError) as e:
        export_hf(model, tmp_path / "hf")
    assert "cannot export as MixtralForCausalLM" in str(e.value) and message in str(e.value)
    assert not (tmp_path / "hf").exists()  # nothing written


def test_a_missing_expert_tensor_is_named(tmp_path):
    hf = _hf_mixtral(tmp_path / "hf")
    model = _import(hf, tmp_path / "a.toml")  # loads while the directory is whole
    weights = load_file(str(hf / "model.safetensors"))
    del weights["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(weights, str(hf / "model.safetensors"), metadata={"format": "pt"})
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    assert any(f"the weights lack {name}" in p for p in hf_dir_problems(hf))
    with pytest.raises(UserError, match=f"lack.*{name}"):
        from_hf(hf, tmp_path / "b.toml")
    with pytest.raises(UserError, match=f"lacks {name}"):
        load_hf_weights(model, hf)
    assert not (tmp_path / "b.toml").exists()


def test_extra_experts_and_a_mismatched_router_are_refused(tmp_path):
    hf = _hf_mixtral(tmp_path / "hf")
    from_hf(hf, tmp_path / "a.toml")
    # model.init_from into a model that routes to one expert per token: same shapes, other logits.
    sections = read_toml(str(tmp_path / "a.toml"))
    fields = {k: v for k, v in sections["model"].items() if k != "init_from"}
    moe = MoEConfig(**{**sections["moe"], "top_k": 1})
    model = build_model(resolve_model_args(ModelConfig(**fields), None, 32, moe=moe), 0, "cpu")
    with pytest.raises(ConfigError, match="moe.top_k is 1 but config.json has 2; set moe.top_k = 2"):
        load_hf_weights(model, hf)
    # config.json says 3 experts, the weights hold 4: expert 3 would be dropped.
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "num_local_experts": 3}))
    problems = hf_dir_problems(hf)
    assert any(
        "experts beyond the model's 3 experts" in p
        and "model.layers.0.block_sparse_moe.experts.3.w1.weight" in p
        for p in problems
    ), problems


def _run_checkpoint(root: Path, **moe) -> Path:
    """A run directory with one committed checkpoint of a tiny MoE (what `scaletrain train` leaves)."""
    cfg = Config()
    cfg.model = dataclasses.replace(cfg.model, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48)
    cfg.moe = dataclasses.replace(cfg.moe, n_experts=4, top_k=2, hidden=24, **moe)
    cfg.data.seq_len = 32
    root.mkdir()
    (root / "config.toml").write_text(tomli_w.dumps(to_dict(cfg)))
    args = resolve_model_args(cfg.model, load_tokenizer("byte").vocab_size, cfg.data.seq_len, moe=cfg.moe)
    model = build_model(args, seed=0, device="cpu")
    _decisive_router(_gates(model))
    ckpt = root / "checkpoints" / "step-00000002"
    dcp.save({"model": ModelState([model])}, checkpoint_id=str(ckpt), no_dist=True)
    # With checksums: a checkpoint directory given by itself is verified.
    write_commit(fsspec.filesystem("file"), str(ckpt), {"step": 2})
    return ckpt


def test_convert_to_hf_reports_the_measured_logits_diff_and_refuses_shared_experts(tmp_path):
    msg = to_hf(_run_checkpoint(tmp_path / "run"), tmp_path / "hf")
    assert "transformers.MixtralForCausalLM logits match (max abs diff" in msg
    diff = float(msg.rsplit("max abs diff ", 1)[1].rstrip(")"))
    assert diff <= 1e-5
    with pytest.raises(
        ConfigError, match="moe.shared_experts is 2; MixtralForCausalLM has no shared experts"
    ):
        to_hf(_run_checkpoint(tmp_path / "run2", shared_experts=2), tmp_path / "hf2")
