"""The model families against the installed transformers' own classes (issue 36): Qwen3, Qwen3-MoE and GPT-OSS
built from small random configs (never downloaded), imported and exported through checkpoint/hf, with logits and
greedy generation equal in fp32; and the published presets' parameter counts, counted on the meta device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scaletrain.checkpoint.convert import from_hf
from scaletrain.checkpoint.hf.core import export_hf, verify_with_transformers
from scaletrain.checkpoint.hf.sharded import load_hf_weights
from scaletrain.config import ModelConfig, MoEConfig
from scaletrain.config.io import read_toml
from scaletrain.errors import ConfigError
from scaletrain.inference.generate import generate
from scaletrain.metrics.mfu import attention_flops_per_token, flops_per_token, model_flops_per_token
from scaletrain.models import ModelArgs, build_meta_model, build_model, resolve_model_args
from scaletrain.models.gpt_oss import PUBLISHED as GPT_OSS_PUBLISHED
from scaletrain.models.llama import count_parameters
from scaletrain.models.moe import MoE
from scaletrain.models.qwen3 import PUBLISHED as QWEN3_PUBLISHED
from scaletrain.validate import load_config

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 20
BASE = dict(vocab_size=VOCAB, max_seq_len=32, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=48)
# head_size 16 where dim / n_heads is 8: the explicit head size is exercised.
FAMILIES = {
    "qwen3": dict(family="qwen3", qk_norm=True, head_size=16, rope_theta=1e6, norm_eps=1e-6),
    "qwen3_moe": dict(
        family="qwen3", qk_norm=True, head_size=16, rope_theta=1e6, norm_eps=1e-6, n_experts=4, top_k=2,
        moe_hidden=24, first_dense=1,
    ),
    # A window of 6 on layers 0 and 2; a SwiGLU limit of 0.3, so that the clamps bite at these scales; YaRN RoPE
    # (factor 8 over 16 positions, so that its ramp spans these 8 frequencies).
    "gpt_oss": dict(
        family="gpt_oss", head_size=16, rope_theta=150000.0, attention_bias=True, attention_sinks=True,
        moe_bias=True, swiglu_limit=0.3, window=6, window_every=2, n_experts=4, top_k=2, moe_hidden=24,
        rope_scaling="yarn", rope_scaling_factor=8.0, rope_original_max_len=16, rope_yarn_truncate=False,
    ),
}  # fmt: skip
HF_CLASS = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}


def _hf_config(kind: str) -> object:
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )  # fmt: skip
    if kind != "gpt_oss":
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    if kind == "qwen3":
        return transformers.Qwen3Config(**common)
    if kind == "gpt_oss":
        return transformers.GptOssConfig(
            **common | {"intermediate_size": 24, "rms_norm_eps": 1e-5},
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "original_max_position_embeddings": 16,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            },
            num_local_experts=4, num_experts_per_tok=2, sliding_window=6, swiglu_limit=0.3,
        )  # fmt: skip
    return transformers.Qwen3MoeConfig(
        **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
        mlp_only_layers=[0],
    )  # fmt: skip


def _randomise(model: torch.nn.Module) -> None:
    """Norm weights away from 1 (QK-norm and the block norms must be read, not assumed), biases and sinks away from
    their zero init (each must land in its place), and decisive routers (at std 0.02 a near-tie could flip between
    two implementations on rounding alone)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif "bias" in name or "sinks" in name or "experts.b" in name:
                p.normal_(0.0, 0.5, generator=gen)
            elif ("router" in name or ".gate." in name) and p.dim() == 2 and p.shape[0] == 4:
                p.normal_(0.0, 1.0, generator=gen)


def _ours(kind: str) -> torch.nn.Module:
    model = build_model(ModelArgs(**BASE, **FAMILIES[kind]), seed=0, device="cpu")
    _randomise(model)
    return model.eval()


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _hf_load(path: Path, kind: str) -> torch.nn.Module:
    cls = getattr(transformers, HF_CLASS[kind])
    return cls.from_pretrained(str(path), dtype=torch.float32).eval()


def _greedy_equal(ours: torch.nn.Module, hf: torch.nn.Module) -> None:
    prompt = [3, 17, 5, 42, 9]
    mine = generate(ours, prompt, max_new_tokens=10).tokens
    theirs = hf.generate(
        torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None
    )[0, len(prompt) :].tolist()
    assert mine == theirs


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_export_loads_in_transformers_with_equal_logits_and_greedy_tokens(tmp_path, kind):
    model = _ours(kind)
    export_hf(model, tmp_path / "hf")
    hf = _hf_load(tmp_path / "hf", kind)
    x = _tokens()
    with torch.no_grad():
        diff = (hf(x).logits - model(x)).abs().max().item()
    assert diff <= 1e-5
    assert verify_with_transformers(model, tmp_path / "hf") <= 1e-5
    _greedy_equal(model, hf)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_transformers_checkpoint_imports_with_equal_logits_and_greedy_tokens(tmp_path, kind):
    torch.manual_seed(0)
    hf = getattr(transformers, HF_CLASS[kind])(_hf_config(kind)).eval()
    _randomise(hf)
    hf.save_pretrained(str(tmp_path / "hf"))
    # `scaletrain convert --from hf`, then the model its config builds with model.init_from's weights.
    from_hf(tmp_path / "hf", tmp_path / "a.toml")
    sections = read_toml(str(tmp_path / "a.toml"))
    fields = {k: v for k, v in sections["model"].items() if k != "init_from"}
    assert fields["family"] == kind.removesuffix("_moe") and fields["head_size"] == 16
    args = resolve_model_args(ModelConfig(**fields), None, 32, moe=MoEConfig(**sections.get("moe", {})))
    model = build_model(args, seed=1, device="cpu")
    load_hf_weights(model, tmp_path / "hf")
    model.eval()
    moe_blocks = {"qwen3": 0, "qwen3_moe": 2, "gpt_oss": 3}[kind]
    assert sum(isinstance(b.feed_forward, MoE) for b in model.layers.values()) == moe_blocks
    x = _tokens()
    with torch.no_grad():
        diff = (hf(x).logits - model(x)).abs().max().item()
    assert diff <= 1e-5
    _greedy_equal(model, hf)


PUBLISHED = QWEN3_PUBLISHED | GPT_OSS_PUBLISHED


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_published_presets_count_the_published_parameters(preset):
    args = resolve_model_args(ModelConfig(preset=preset), None, 4096)
    counts = count_parameters(build_meta_model(args))
    total, active = PUBLISHED[preset]
    # The model cards round to one decimal (1.72B is "1.7B").
    assert counts["total"] / 1e9 == pytest.approx(total, rel=0.02)
    if active is not None:  # Qwen3's cards count the input embedding as active, GPT-OSS's card does not
        embedding = args.vocab_size * args.dim if args.family == "qwen3" else 0
        assert (counts["active"] + embedding) / 1e9 == pytest.approx(active, rel=0.02)


def _problems(*overrides: str, world_size: int = 1) -> list[str]:
    try:
        load_config(None, list(overrides), world_size=world_size, check_run_dir=False)
    except ConfigError as e:
        return e.problems
    return []


def test_a_family_preset_keeps_its_features_and_context_parallel_is_refused_for_gpt_oss():
    # The preset's window (unset in [model]) is what the model builds with and what the validator checks.
    args = resolve_model_args(ModelConfig(preset="debug_gpt_oss"), None, 64)
    assert (args.window, args.window_every, args.attention_sinks, args.family) == (16, 2, True, "gpt_oss")
    refused = _problems("--model.preset", "debug_gpt_oss", "--parallel.cp", "2", world_size=2)
    assert any("model.attention_sinks" in p and "parallel.cp" in p for p in refused), refused
    assert any("model.window are not supported with parallel.cp > 1" in p for p in refused), refused
    # Qwen3 has neither: context parallel is accepted (ring attention runs its QK-normed heads like any others).
    assert _problems("--model.preset", "debug_qwen3", "--parallel.cp", "2", world_size=2) == []


def test_flops_count_each_layers_window_and_the_head_size():
    args = ModelArgs(**BASE, **FAMILIES["gpt_oss"])  # window 6 on layers 0 and 2 of 3, head_size 16 x 4 heads
    s, width = 32, 4 * 16
    # Keys per query: the causal band's area over s, s/2 without a window and w - w²/(2s) with one.
    keys = [6 - 36 / 64, s / 2, 6 - 36 / 64]
    assert attention_flops_per_token(args, s) == pytest.approx(6 * 2 * width * sum(keys))
    # As the sink kernel runs (the planner's time): the whole square, every layer.
    assert attention_flops_per_token(args, s, as_run=True) == pytest.approx(6 * 2 * width * 3 * s)
    # A Llama (head_dim x heads = dim, no window) keeps the 6N + 6·L·d·s of flops_per_token.
    assert model_flops_per_token(1000, ModelArgs(**BASE), s) == flops_per_token(1000, 3, 32, s)
    assert model_flops_per_token(1000, args, s) == 6000 + attention_flops_per_token(args, s)
