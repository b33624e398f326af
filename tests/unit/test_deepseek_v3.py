"""The DeepSeek-V3 family against transformers' DeepseekV3ForCausalLM, built from a tiny config with random weights
(never downloaded): multi-head latent attention (a query latent, the interleaved rotary part), group-limited sigmoid
routing with the correction bias, the routed scale, shared experts and a dense first block. Logits within 1e-5 in
fp32 both ways through safetensors, and greedy generation (our latent kv cache) token for token."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from scaletrain.checkpoint.convert import from_hf
from scaletrain.checkpoint.hf import deepseek_v3 as adapter
from scaletrain.checkpoint.hf.core import export_hf, verify_with_transformers
from scaletrain.checkpoint.hf.sharded import load_hf_weights
from scaletrain.config import ModelConfig, MoEConfig
from scaletrain.config.io import read_toml
from scaletrain.errors import ConfigError
from scaletrain.inference.generate import generate
from scaletrain.metrics.mfu import attention_flops_per_token
from scaletrain.models import build_meta_model, build_model, count_parameters, resolve_model_args
from scaletrain.models.deepseek_v3 import PUBLISHED
from scaletrain.models.kv_cache import KVCache
from scaletrain.models.llama import ModelArgs, build_feed_forward
from scaletrain.models.mla import MLA
from scaletrain.models.moe import MoE
from scaletrain.optim.optimizers import RoutingBias
from scaletrain.planning.estimators.memory import attention_parameters, block_parameters
from scaletrain.planning.estimators.moe import ffn_shape
from scaletrain.planning.estimators.time import _matmuls, _Shape, mla_projections
from scaletrain.validate import load_config
from tests.fixtures import TINY_DEEPSEEK_V3

transformers = pytest.importorskip("transformers")

ARGS = ModelArgs(
    **TINY_DEEPSEEK_V3,
    dim=64,
    n_layers=3,
    ffn_hidden=96,
    vocab_size=96,
    norm_eps=1e-6,
    max_seq_len=32,
    v_head_dim=6,
    moe_hidden=16,
)


def _tokens(n: int = 20) -> torch.Tensor:
    return torch.randint(0, ARGS.vocab_size, (2, n), generator=torch.Generator().manual_seed(0))


def _hf_model(path: Path):
    cls = transformers.DeepseekV3ForCausalLM
    return cls.from_pretrained(str(path), dtype=torch.float32).eval()


def _spread_router(model) -> None:
    """Router weights and correction biases far from ties, so float rounding cannot flip a choice."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.layers.values():
            ff = layer.feed_forward
            if hasattr(ff, "router"):
                ff.router.gate.weight.normal_(0, 1.0, generator=gen)
                ff.router.expert_bias.normal_(0, 0.5, generator=gen)


def test_export_logits_and_greedy_generation_match_transformers(tmp_path):
    model = build_model(ARGS, seed=3, device="cpu").eval()
    _spread_router(model)
    export_hf(model, tmp_path / "hf")
    hf = _hf_model(tmp_path / "hf")
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), rtol=0, atol=1e-5)
    assert verify_with_transformers(model, tmp_path / "hf") <= 1e-5
    prompt = x[0, :5].tolist()
    ours = generate(model, prompt, max_new_tokens=12).tokens
    # The whole prompt attended (its token 0 is not padding), transformers' own kv cache.
    mask = torch.ones(1, 5, dtype=torch.long)
    theirs = hf.generate(
        x[:1, :5], attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None
    )
    assert ours == theirs[0, 5:].tolist()


def test_import_logits_match_transformers(tmp_path):
    cfg = transformers.DeepseekV3Config(**adapter.export_config(ARGS))
    torch.manual_seed(5)
    hf = transformers.DeepseekV3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in hf.model.layers[ARGS.first_dense :]:
            layer.mlp.gate.weight.normal_(0, 1.0, generator=gen)
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.5, generator=gen)
    hf.save_pretrained(str(tmp_path / "hf"))
    # `scaletrain convert --from hf`, then the model its config builds with model.init_from's weights.
    from_hf(tmp_path / "hf", tmp_path / "a.toml")
    sections = read_toml(str(tmp_path / "a.toml"))
    fields = {k: v for k, v in sections["model"].items() if k != "init_from"}
    args = resolve_model_args(ModelConfig(**fields), None, 32, moe=MoEConfig(**sections.get("moe", {})))
    assert args == dataclasses.replace(ARGS, aux_loss_coef=0.0001)  # DeepSeek-V3's sequence-wise alpha
    model = build_model(args, seed=1, device="cpu")
    load_hf_weights(model, tmp_path / "hf")
    model.eval()
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=0, atol=1e-5)


def test_export_refuses_what_deepseek_v3_cannot_hold():
    args = ModelArgs(family="deepseek_v3", n_experts=4, router="softmax", capacity_factor=1.0)
    problems = adapter.export_problems(args, {})
    assert any("kv_lora_rank is 0" in p for p in problems)
    assert any("moe.router is 'softmax'" in p for p in problems)
    assert any("capacity_factor" in p for p in problems)


# -- routing: group-limited sigmoid choice, the routed scale, the auxiliary-loss-free bias -------------------------

E, GROUPS = 8, 4


def _moe(seed: int = 0, **kw) -> MoE:
    """A float64 DeepSeek-style MoE layer: sigmoid scores, 4 groups of 2 experts, top-3 from the best 2 groups."""
    fields = dict(
        dim=16, ffn_hidden=24, n_experts=E, top_k=3, moe_hidden=12, router="sigmoid", n_group=GROUPS
    )
    moe = build_feed_forward(ModelArgs(**{**fields, "topk_group": 2, "route_scale": 2.5, **kw}), 0).double()
    torch.manual_seed(seed)
    moe.init_weights(0.5, 0.3)
    return moe


def _reference_choice(moe: MoE, t: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """One token as DeepSeek-V3 routes it: the topk_group groups with the best sum of two biased scores, the
    top_k biased scores within them; weights from the unbiased scores, normalised, times the routed scale."""
    r = moe.router
    scores = torch.sigmoid(r.gate.weight @ t)
    biased = (scores + r.expert_bias.double()).tolist()
    size = E // GROUPS
    group_score = [sum(sorted(biased[g * size : (g + 1) * size])[-2:]) for g in range(GROUPS)]
    groups = sorted(range(GROUPS), key=lambda g: -group_score[g])[: r.topk_group]
    allowed = [e for g in groups for e in range(g * size, (g + 1) * size)]
    chosen = sorted(sorted(allowed, key=lambda e: -biased[e])[: r.top_k])
    w = scores[chosen]
    return chosen, w / w.sum() * r.scale


def test_group_limited_routing_and_scale_match_a_per_token_reference():
    moe = _moe()
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, E)[torch.randperm(E)])
    x = torch.randn(40, 16, dtype=torch.float64)
    weights, experts, _, _ = moe.router(x)
    for t, w, ex in zip(x, weights, experts, strict=True):
        chosen, ref_w = _reference_choice(moe, t)
        order = torch.argsort(ex)
        assert ex[order].tolist() == chosen
        torch.testing.assert_close(w[order], ref_w)
    # Group-limited: no token's experts span more than topk_group groups.
    assert max(len(set((e // 2).tolist())) for e in experts) <= 2


def test_bias_update_equals_the_direct_computation():
    """The step's load (counted by the layer as it routes) moves each bias by rate x sign(mean - load)."""
    moe = _moe(seed=1)
    start = torch.linspace(-0.1, 0.1, E)
    with torch.no_grad():
        moe.router.expert_bias.copy_(start)
    x = torch.randn(2, 30, 16, dtype=torch.float64)
    moe(x)
    load = torch.zeros(E)
    for t in x.reshape(-1, 16):
        load[_reference_choice(moe, t)[0]] += 1
    RoutingBias([moe], E, 0.01, None).step()
    expected = start.double() + 0.01 * torch.sign(load.mean() - load).double()
    torch.testing.assert_close(moe.router.expert_bias, expected)


def test_per_expert_load_balances_over_steps_on_a_skewed_router():
    """Experts 0 and 1 score higher for every token (their gate rows aligned with a direction all inputs share):
    without balancing they take nearly every token. The bias update alone (no loss, no gradient) brings the
    busiest expert to within 30% of the mean load, on average over the last 20 steps (a sign update oscillates by
    its rate; 1024 tokens a step leave a sampling noise of ~6% per expert), and leaves the gate as it was."""
    torch.manual_seed(0)
    moe = _moe(seed=2, n_group=1, topk_group=1, top_k=2)
    u = torch.randn(16, dtype=torch.float64)
    with torch.no_grad():
        moe.router.gate.weight[:2] += 3 * u / u.dot(u)
    gate = moe.router.gate.weight.clone()
    update = RoutingBias([moe], E, 0.01, None)
    ratios = []
    for _ in range(150):
        moe(torch.randn(8, 128, 16, dtype=torch.float64) + u)
        load = moe.tokens_per_expert.clone()
        ratios.append(float(load.max() / load.mean()))
        update.step()
        moe.reset_stats()
    assert ratios[0] > 3.0  # 4 is every token's two experts among 0 and 1
    assert sum(ratios[-20:]) / 20 < 1.3 and max(ratios[-20:]) < 1.5
    assert torch.equal(moe.router.gate.weight, gate)


def test_preset_counts_match_the_published_model():
    """DeepSeek-V3 on the meta device: 671B parameters, 37B activated per token (with the input embedding, as the
    paper counts them; the MTP module apart)."""
    args = resolve_model_args(ModelConfig(preset="deepseek_v3_671b"), None, 4096)
    n = count_parameters(build_meta_model(args))
    total, active = PUBLISHED["deepseek_v3_671b"]
    assert n["total"] == pytest.approx(total, rel=0.002)
    assert n["active"] + args.vocab_size * args.dim == pytest.approx(active, rel=0.02)
    assert sum(isinstance(b.attention, MLA) for b in build_meta_model(args).layers.values()) == 61


DS = ["--model.preset", "debug_deepseek_v3", "--parallel.data_parallel", "fsdp"]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--parallel.tp", "2"], "not supported with parallel.tp > 1 or cp > 1"),
        (["--parallel.cp", "2"], "not supported with parallel.tp > 1 or cp > 1"),
        (["--optimizer.qk_clip", "100"], "optimizer.qk_clip with multi-head latent attention"),
        (["--moe.n_group", "3"], "moe.n_group 3 must divide moe.n_experts 8"),
        (["--moe.topk_group", "1", "--moe.top_k", "3"], "moe.top_k 3 exceeds the 2 experts"),
        (["--model.qk_rope_head_dim", "7"], "model.qk_rope_head_dim 7 is odd"),
        (["--model.mtp_depth", "1", "--parallel.ep", "2"], "model.mtp_depth > 0 is not supported with"),
        (["--model.mtp_depth", "1", "--parallel.pp", "2"], "model.mtp_depth > 0 is not supported with"),
        (
            ["--model.mtp_depth", "1", "--data.document_mask", "true"],
            "model.mtp_depth with data.document_mask",
        ),
        (["--model.mtp_depth", "2"], "model.mtp_depth must be 0 or 1"),
    ],
)
def test_the_validator_refuses_what_mla_and_grouped_routing_cannot_take(flags, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*DS, *flags], world_size=2)
    assert any(words in p for p in e.value.problems), e.value.problems


def test_the_validator_accepts_the_layouts_trained_against_the_single_process():
    # tests/distributed/test_deepseek_v3.py trains these (and pp 2 with 1F1B) against one process.
    pp = ["--parallel.pp", "2", "--training.micro_batch", "2"]
    for flags in ([], ["--parallel.ep", "2"], pp, ["--model.mtp_depth", "1"]):
        cfg = load_config(
            None, [*DS, "--training.global_batch", "8", "--training.micro_batch", "4", *flags], 2
        )
        assert cfg.model.preset == "debug_deepseek_v3"


# -- multi-token prediction ---------------------------------------------------------------------------------------


def test_mtp_adds_its_weighted_loss_in_training_only():
    """The step's mean loss is the main cross-entropy plus coef x the MTP module's mean cross-entropy, computed
    here by hand from the module's pieces; evaluation (eval mode) and the logits ignore it; off adds nothing."""
    args = dataclasses.replace(ARGS, mtp_depth=1, mtp_loss_coef=0.25)
    model = build_model(args, seed=0, device="cpu")
    x = _tokens(12)
    y = torch.roll(x, -1, dims=1)
    with torch.no_grad():
        main = F.cross_entropy(model.eval()(x).flatten(0, 1), y.flatten())
        mtp = model.mtp
        hidden = model.tok_embeddings(x)
        cos, sin = model.rope[: x.shape[1]].unbind(-2)
        for layer in model.layers.values():
            hidden = layer(hidden, cos, sin)
        pieces = torch.cat([mtp.enorm(model.tok_embeddings(y[:, :-1])), mtp.hnorm(hidden[:, :-1])], dim=-1)
        h = mtp.norm(mtp.block(mtp.eh_proj(pieces), cos[:-1], sin[:-1]))
        extra = F.cross_entropy(model.output(h).flatten(0, 1), y[:, 1:].flatten())
        trained = model.train()(x, targets=y) / y.numel()
        evaluated = model.eval()(x, targets=y) / y.numel()
    torch.testing.assert_close(trained, main + 0.25 * extra)
    torch.testing.assert_close(evaluated, main)
    plain = build_model(ARGS, seed=0, device="cpu")  # off: no module, the same draws for everything else
    assert plain.mtp is None
    ours = dict(model.named_parameters())
    assert all(torch.equal(p, ours[k]) for k, p in plain.named_parameters())
    loss = model.train()(x, targets=y)
    loss.backward()
    assert model.mtp.eh_proj.weight.grad.abs().sum() > 0
    # MFU counts its block's attention as one more layer's (its weights are in N already).
    layers = ARGS.n_layers
    assert attention_flops_per_token(args, 12) == attention_flops_per_token(ARGS, 12) * (layers + 1) / layers


def test_absorbed_decoding_equals_the_expanded_cache():
    """Decoding steps in the latent space (wkv_b absorbed) give the logits of keys and values expanded per head,
    and of the uncached forward over the whole sequence."""
    model = build_model(ARGS, seed=4, device="cpu").eval()
    _spread_router(model)
    x = _tokens(14)[:1]
    logits = {}
    for absorb in (True, False):
        for layer in model.layers.values():
            layer.attention.absorb = absorb
        cache = KVCache(ARGS.n_layers, x.shape[1])
        with torch.no_grad():
            steps = [model(x[:, :6], cache=cache)[:, -1]]
            steps += [model(x[:, i : i + 1], cache=cache)[:, -1] for i in range(6, x.shape[1])]
        logits[absorb] = torch.stack(steps[:-1], dim=1)
    with torch.no_grad():
        whole = model(x)[:, 5:-1]
    torch.testing.assert_close(logits[True], logits[False], rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[True], whole, rtol=0, atol=1e-5)


def test_the_planner_counts_mla_parameters_as_built():
    """The memory estimate's per-block parameters (MLA's projections and latent norms, the MoE's dense part and
    routed experts averaged over the blocks) add up to the model built on the meta device."""
    for preset in ("debug_deepseek_v3", "deepseek_v3_671b"):
        args = resolve_model_args(ModelConfig(preset=preset), 256, 4096)
        split, rep = block_parameters(args)
        blocks = args.n_layers * (split + rep + ffn_shape(args).routed)
        tables = 2 * args.vocab_size * args.dim + args.dim
        assert blocks + tables == pytest.approx(count_parameters(build_meta_model(args))["total"], rel=1e-12)


def test_the_time_model_counts_mla_matmuls_as_they_run():
    """The time model's forward FLOPs of an MLA block: its projections are the attention weights (each token once),
    QKᵀ over nope + rope channels a head and AV over v_head_dim."""
    args = resolve_model_args(ModelConfig(preset="deepseek_v3_671b"), None, 4096)
    assert sum(mla_projections(args)) == attention_parameters(args)[0]
    heads = args.n_heads
    qk, v = heads * (args.qk_nope_head_dim + args.qk_rope_head_dim), heads * args.v_head_dim
    shape = _Shape(8.0, 4096, args.dim, qk, 0.0, 1.0, keys=100.0, v=v, proj=mla_projections(args))
    flops = _matmuls(shape)
    assert len(flops) == len(mla_projections(args)) + 5
    assert sum(flops[:-5]) == 2 * 8 * attention_parameters(args)[0]
    assert flops[-2:] == [2 * 8 * 100 * qk, 2 * 8 * 100 * v]
