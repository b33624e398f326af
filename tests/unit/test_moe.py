"""The MoE feed-forward against a naive per-token reference, its capacity dropping, its balance and z losses, its
statistics, the MoE presets' parameter counts, and a few training steps of the debug MoE."""

import ast
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from scaletrain.config import ModelConfig
from scaletrain.errors import ConfigError
from scaletrain.models import ModelArgs, build_meta_model, build_model, count_parameters, resolve_model_args
from scaletrain.models.llama import FeedForward, build_feed_forward
from scaletrain.models.moe import (
    MoE,
    _probe_grouped_mm,
    _swiglu_grouped,
    _swiglu_loop,
    capacity_keep,
    is_moe_layer,
    set_aux_loss_scale,
)
from scaletrain.validate import load_config

DIM, E = 16, 6


def make_moe(seed: int = 0, **kw) -> MoE:
    """A float64 MoE layer with weights large enough that routing and outputs are far from ties and zeros."""
    fields = dict(dim=DIM, ffn_hidden=24, n_experts=E, top_k=2, moe_hidden=12)
    moe = build_feed_forward(ModelArgs(**{**fields, **kw}), 0).double()
    torch.manual_seed(seed)
    moe.init_weights(0.5, 0.3)
    return moe


def naive(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: score the experts, take the top k (by score + bias), run each through its SwiGLU."""
    r, ex = moe.router, moe.experts
    out = []
    for t in x.reshape(-1, x.shape[-1]):
        logits = r.gate.weight @ t
        scores = torch.sigmoid(logits) if r.score == "sigmoid" else torch.softmax(logits, -1)
        chosen = torch.topk(scores.detach() + r.expert_bias.double(), r.top_k).indices
        w = scores[chosen]
        if r.score == "sigmoid" or r.norm_topk:
            w = w / w.sum()
        y = sum(
            wi * (ex.w2[e] @ (F.silu(ex.w1[e] @ t) * (ex.w3[e] @ t))) for wi, e in zip(w, chosen.tolist())
        )
        if moe.shared is not None:
            y = y + moe.shared(t)
        out.append(y)
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(norm_topk=False, top_k=3),
        dict(router="sigmoid", norm_topk=False),
        dict(shared_experts=2),
    ],
    ids=["softmax", "softmax-unnormalised-top3", "sigmoid", "shared"],
)
def test_moe_equals_per_token_reference_forward_and_backward(kw):
    moe = make_moe(**kw)
    if kw.get("router") == "sigmoid":  # the bias must change the choice, never the weights
        moe.router.expert_bias.copy_(torch.tensor([0.0, 0.3, -0.2, 0.0, 0.1, -0.4]))
    x = torch.randn(2, 5, DIM, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 5, DIM, dtype=torch.float64)
    wrt = [x, moe.router.gate.weight, moe.experts.w1, moe.experts.w2, moe.experts.w3]
    wrt += list(moe.shared.parameters()) if moe.shared is not None else []
    out, ref = moe(x), naive(moe, x)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad((out * g).sum(), wrt), torch.autograd.grad((ref * g).sum(), wrt)):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)
        assert a.abs().sum() > 0


def test_routing_bias_selects_only():
    moe = make_moe(router="sigmoid")
    x = torch.randn(1, 8, DIM, dtype=torch.float64)
    before = moe.router(x.view(-1, DIM))
    moe.router.expert_bias[3] = 10.0  # expert 3 wins every token, but its weight is its own unbiased score
    weights, experts, _, _ = moe.router(x.view(-1, DIM))
    assert (experts == 3).any(-1).all() and not (before[1] == 3).any(-1).all()
    scores = torch.sigmoid(x.view(-1, DIM) @ moe.router.gate.weight.T).gather(-1, experts)
    torch.testing.assert_close(weights, scores / scores.sum(-1, keepdim=True))


def test_capacity_keeps_the_first_assignments_of_each_sequence_in_token_order():
    torch.manual_seed(1)
    experts = torch.stack([torch.randperm(4)[:2] for _ in range(3 * 10)]).view(3, 10, 2)
    keep = capacity_keep(experts, 4, capacity=3)
    for b in range(3):
        seen = [0] * 4
        for s in range(10):
            for j in range(2):
                e = int(experts[b, s, j])
                assert bool(keep[b, s, j]) == (seen[e] < 3)
                seen[e] += 1


def test_capacity_drops_exactly_the_counted_assignments():
    # dim 4 = experts 4; gate = 10 I, so a one-hot token goes to the expert of its hot channel (top-1).
    moe = make_moe(dim=4, n_experts=4, top_k=1, capacity_factor=1.0)  # capacity ceil(1 x 8 x 1 / 4) = 2
    with torch.no_grad():
        moe.router.gate.weight.copy_(10 * torch.eye(4, dtype=torch.float64))
    routes = torch.tensor([[0] * 8, [0, 1, 2, 3, 0, 1, 2, 3]])  # sequence 0 floods expert 0
    x = F.one_hot(routes, 4).double()
    out = moe(x)
    assert moe.dropped_tokens.item() == 6 and moe.routed_tokens.item() == 16
    assert moe.tokens_per_expert.tolist() == [10.0, 2.0, 2.0, 2.0]  # as routed, before the drop
    assert torch.equal(
        out[0, 2:], torch.zeros(6, 4, dtype=torch.float64)
    )  # dropped: only the residual remains
    moe.capacity_factor = 0.0
    torch.testing.assert_close(out[1], moe(x)[1])  # nothing of sequence 1 was dropped
    torch.testing.assert_close(out[0, :2], moe(x)[0, :2])


def hand_balance_loss(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """sum_e f_e P_e per sequence, averaged, written out for one sequence at a time."""
    losses = []
    for seq in x:
        probs = torch.softmax(seq @ moe.router.gate.weight.T, -1)
        chosen = torch.topk(probs, moe.top_k).indices
        counts = torch.stack([(chosen == e).sum() for e in range(moe.n_experts)]).double()
        f = counts * moe.n_experts / (moe.top_k * seq.shape[0])
        losses.append((f * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def aux_grad(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The router gradient the aux losses alone give: the LM path is multiplied by zero."""
    moe.router.gate.weight.grad = None
    (moe(x) * 0).sum().backward()
    return moe.router.gate.weight.grad.clone()


def test_aux_loss_value_and_its_scaled_gradient_reach_the_router():
    moe = make_moe(aux_loss_coef=0.1)
    x = torch.randn(3, 7, DIM, dtype=torch.float64)
    set_aux_loss_scale(moe, 0.25)
    grad = aux_grad(moe, x)
    hand = hand_balance_loss(moe, x)
    torch.testing.assert_close(moe.aux_loss_sum, hand)  # recorded unweighted
    (expected,) = torch.autograd.grad(hand, moe.router.gate.weight)
    torch.testing.assert_close(grad, 0.25 * 0.1 * expected, rtol=1e-10, atol=1e-14)


def test_aux_loss_scale_is_each_layers_own():
    """The scale travels on the layer (set by its owner), so two models in one process train with their own."""
    a, b = make_moe(aux_loss_coef=0.1), make_moe(aux_loss_coef=0.1)
    x = torch.randn(3, 7, DIM, dtype=torch.float64)
    set_aux_loss_scale(nn.Sequential(a), 0.25)  # found inside whatever wraps the layer
    set_aux_loss_scale(b, 0.5)
    torch.testing.assert_close(aux_grad(b, x), 2 * aux_grad(a, x), rtol=1e-12, atol=0)
    assert b.aux_loss_scale == 0.5 and make_moe().aux_loss_scale == 1.0


def test_models_keep_no_module_level_state_a_step_changes():
    """models/ rebinds no module global but a per-process cache (the compiled flex kernel): a per-step value (the
    aux-loss scale) is handed to the modules, not carried in a global that every model in the process reads."""
    import scaletrain.models as models

    rebound = {
        f"{path.name}:{name}"
        for path in Path(models.__file__).parent.glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Global)
        for name in node.names
    }
    assert rebound <= {"attention.py:_compiled_flex"}


def test_z_loss_value_and_gradient():
    moe = make_moe(z_loss_coef=0.01)
    x = torch.randn(2, 5, DIM, dtype=torch.float64)
    grad = aux_grad(moe, x)
    z = torch.logsumexp(x.view(-1, DIM) @ moe.router.gate.weight.T, -1).pow(2).mean()
    torch.testing.assert_close(moe.z_loss_sum, z)
    (expected,) = torch.autograd.grad(0.01 * z, moe.router.gate.weight)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-14)


def test_balance_loss_is_per_sequence_so_any_batch_split_trains_the_same():
    moe = make_moe(aux_loss_coef=0.1)
    x = torch.randn(4, 6, DIM, dtype=torch.float64)
    whole = aux_grad(moe, x)
    halves = (aux_grad(moe, x[:2]) + aux_grad(moe, x[2:])) / 2  # two data-parallel ranks, gradients averaged
    torch.testing.assert_close(whole, halves, rtol=1e-12, atol=1e-15)


def test_statistics_count_training_forwards_only_and_recompute_once():
    moe = make_moe(aux_loss_coef=0.01)
    x = torch.randn(2, 5, DIM, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        moe(x)
    assert moe.forwards.item() == 0 and moe.tokens_per_expert.sum().item() == 0
    # The forward runs again inside backward, to its end (no early stop).
    with set_checkpoint_early_stop(False):
        checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert moe.forwards.item() == 1 and moe.routed_tokens.item() == 2 * 5 * 2
    assert moe.tokens_per_expert.sum().item() == 20


def test_grouped_mm_equals_the_segment_loop():
    torch.manual_seed(0)
    w1, w3, w2 = torch.randn(4, 8, 16), torch.randn(4, 8, 16), torch.randn(4, 16, 8)
    counts = torch.tensor([5, 0, 16, 3])  # an expert with no rows
    x = torch.randn(int(counts.sum()), 16)
    try:
        grouped = _swiglu_grouped(x, w1, w2, w3, counts)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._grouped_mm does not run here: {e}")
    torch.testing.assert_close(grouped, _swiglu_loop(x, w1, w2, w3, counts), rtol=1e-4, atol=1e-4)


def test_grouped_mm_probe_refuses_a_kernel_that_fails_or_is_wrong(monkeypatch):
    cpu = torch.device("cpu")
    try:
        torch._grouped_mm(torch.ones(2, 16, dtype=torch.bfloat16), torch.ones(1, 16, 16, dtype=torch.bfloat16),
                          offs=torch.tensor([2], dtype=torch.int32))  # fmt: skip
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        pytest.skip(f"torch._grouped_mm does not run on CPU here: {e}")
    assert _probe_grouped_mm(cpu)
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda a, b, offs: real(a, b, offs=offs) * 1.5)
    assert not _probe_grouped_mm(cpu)

    def broken(a, b, offs):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(torch, "_grouped_mm", broken)
    assert not _probe_grouped_mm(cpu)


def test_moe_layers_follow_every_and_first_dense():
    args = ModelArgs(n_layers=6, n_experts=4, moe_every=2, first_dense=2)
    assert [is_moe_layer(args, i) for i in range(6)] == [False, False, False, True, False, True]
    model = build_meta_model(args)
    assert [type(b.feed_forward) for b in model.layers.values()] == [FeedForward] * 3 + [
        MoE,
        FeedForward,
        MoE,
    ]
    assert all(type(b.feed_forward) is FeedForward for b in build_meta_model(ModelArgs()).layers.values())


def test_router_bias_is_checkpointed_and_statistics_are_not():
    keys = build_model(ModelArgs(n_layers=1, n_experts=4), 0, "cpu").state_dict()
    assert "layers.0.feed_forward.router.expert_bias" in keys
    assert not any("tokens_per_expert" in k or "forwards" in k for k in keys)


def counts(preset: str) -> dict[str, int]:
    return count_parameters(build_meta_model(resolve_model_args(ModelConfig(preset=preset), None, 128)))


def test_debug_moe_active_parameters_are_top_k_of_the_routed_experts():
    n = counts("debug_moe")
    per_expert = 3 * 128 * 176
    assert n["non_embedding"] - n["active"] == 4 * per_expert * (8 - 2)
    dense = counts("debug")
    # Two experts of half the dense hidden size: the dense model's FFN, plus the router.
    assert n["active"] == dense["non_embedding"] + 4 * 8 * 128


def test_moe_preset_parameter_counts_match_the_published_models():
    emb = {"mixtral_8x7b": 32000 * 4096, "deepseek_moe_16b": 102400 * 2048}
    mixtral = counts("mixtral_8x7b")
    assert mixtral["total"] == pytest.approx(46.7e9, rel=0.003)
    assert mixtral["active"] + emb["mixtral_8x7b"] == pytest.approx(12.9e9, rel=0.005)  # published with emb.
    ds = counts("deepseek_moe_16b")
    assert ds["total"] == pytest.approx(16.4e9, rel=0.01)
    assert ds["active"] + emb["deepseek_moe_16b"] == pytest.approx(2.8e9, rel=0.02)
    # deepseek_v3_671b, with MLA since issue 36: tests/unit/test_deepseek_v3.py against the published counts.


def test_debug_moe_trains():
    torch.manual_seed(0)
    args = resolve_model_args(ModelConfig(preset="debug_moe"), 256, 32)
    model = build_model(args, 0, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (4, 33))
    losses = []
    for _ in range(8):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab_size), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert math.isfinite(losses[-1]) and losses[-1] < losses[0] - 0.5
    assert all(
        p.grad is not None for p in model.parameters()
    )  # every expert, router and shared weight learns


def config_problems(*overrides: str) -> str:
    try:
        load_config("configs/debug_moe.toml", list(overrides), check_run_dir=False)
    except ConfigError as e:
        return str(e)
    return ""


def test_validate_refuses_bad_moe_shapes_naming_the_knob():
    msg = config_problems("--moe.top_k", "9", "--moe.every", "0", "--moe.capacity_factor", "-1")
    assert "moe.top_k 9 must be between 1 and moe.n_experts 8 (from model.preset 'debug_moe')" in msg
    assert "moe.every 0 must be >= 1" in msg
    assert "moe.capacity_factor must be >= 0" in msg
    dense = config_problems("--model.preset", "debug", "--moe.top_k", "2")
    assert "moe.top_k is set, but the model is dense" in dense
    assert "training.compile with MoE blocks is refused" in config_problems("--training.compile", "true")
    assert config_problems() == ""
