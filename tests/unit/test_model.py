import pytest
import torch
import torch.nn.functional as F

from scaletrain.config import ModelConfig
from scaletrain.models import build_meta_model, count_parameters, resolve_model_args
from scaletrain.models.presets import PRESETS
from tests.fixtures import tiny


def test_changing_a_later_token_leaves_earlier_logits_unchanged():
    model = tiny()
    x = torch.randint(0, 64, (2, 16))
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % 64
    a, b = model(x), model(y)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_meta_build_then_init_is_deterministic_and_finite():
    a, b = tiny(), tiny()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
        assert torch.isfinite(p).all(), n
    assert not any(p.is_meta for p in a.parameters())


def test_explicit_positions_equal_default_positions():
    model = tiny()
    x = torch.randint(0, 64, (1, 12))
    assert torch.allclose(model(x), model(x, positions=torch.arange(12)))


def test_tied_embeddings_share_storage():
    model = tiny(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    loss = F.cross_entropy(model(torch.randint(0, 64, (2, 8))).flatten(0, 1), torch.randint(0, 64, (16,)))
    loss.backward()
    assert model.tok_embeddings.weight.grad is not None


@pytest.mark.parametrize(
    "name,expected", [("8B", 8.03e9), ("70B", 70.55e9), ("405B", 405.85e9), ("1B", 1.236e9)]
)
def test_presets_count_published_sizes_on_meta(name, expected):
    args = resolve_model_args(ModelConfig(preset=name), 128256, 2048)
    total = count_parameters(build_meta_model(args))["total"]
    assert abs(total - expected) / expected < 0.002


def test_debug_preset_is_about_one_million_parameters():
    args = resolve_model_args(ModelConfig(), tokenizer_vocab=257, max_seq_len=64)
    assert args.vocab_size == 320  # 257 rounded up to a multiple of 64
    assert 0.5e6 < count_parameters(build_meta_model(args))["total"] < 1.5e6
    assert set(PRESETS) >= {"debug", "125M", "1B", "8B", "70B", "405B"}


def test_config_fields_override_the_preset():
    args = resolve_model_args(ModelConfig(preset="8B", n_layers=2, rope_theta=1e4), None, 128)
    assert (args.n_layers, args.dim, args.rope_theta, args.rope_scaling) == (2, 4096, 1e4, "llama3")


def test_logits_match_huggingface_llama():
    """Same weights in transformers' LlamaForCausalLM give the same logits (the HF interop contract)."""
    transformers = pytest.importorskip("transformers")
    model = tiny(rope_theta=10000.0)
    a = model.args
    hf_cfg = transformers.LlamaConfig(
        vocab_size=a.vocab_size,
        hidden_size=a.dim,
        intermediate_size=a.ffn_hidden,
        num_hidden_layers=a.n_layers,
        num_attention_heads=a.n_heads,
        num_key_value_heads=a.n_kv_heads,
        rms_norm_eps=a.norm_eps,
        rope_theta=a.rope_theta,
        max_position_embeddings=a.max_seq_len,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    sd = {
        "model.embed_tokens.weight": model.tok_embeddings.weight,
        "model.norm.weight": model.norm.weight,
        "lm_head.weight": model.output.weight,
    }
    names = {
        "attention.wq": "self_attn.q_proj",
        "attention.wk": "self_attn.k_proj",
        "attention.wv": "self_attn.v_proj",
        "attention.wo": "self_attn.o_proj",
        "feed_forward.w1": "mlp.gate_proj",
        "feed_forward.w2": "mlp.down_proj",
        "feed_forward.w3": "mlp.up_proj",
        "attention_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    for i, layer in model.layers.items():
        for ours, theirs in names.items():
            sd[f"model.layers.{i}.{theirs}.weight"] = layer.get_submodule(ours).weight
    missing, unexpected = hf.load_state_dict({k: v.detach() for k, v in sd.items()}, strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    x = torch.randint(0, a.vocab_size, (2, 16))
    with torch.no_grad():
        assert (hf(x).logits - model(x)).abs().max() < 1e-5
