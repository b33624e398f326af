"""QK-clip on one process (optimizer.qk_clip, scaletrain/optim/qk_clip.py): the per-head logit maximum against the whole
logit matrix under every mask, the clip of a crafted model (exactly the heads over τ rescaled to τ, the others bit for
bit untouched, for multi-head and grouped-query attention), skipped steps, evaluation, the off default, the
refusals, and the measuring memory the memory estimate counts."""

from __future__ import annotations

import math

import pytest
import torch

from scaletrain.config import Config, OptimizerConfig, ParallelConfig, TrainingConfig
from scaletrain.job import build_core
from scaletrain.models import attention
from scaletrain.models.attention import _block_mask, _bool_mask, max_logits, max_logits_bytes
from scaletrain.optim.qk_clip import QKClip, attention_layers, head_scales, qk_clip_problems
from scaletrain.parallel.mesh import ParallelDims
from scaletrain.planning.estimators.memory import per_rank_bytes
from tests.fixtures import LiveBytes, tiny

CPU = torch.device("cpu")


def _dense_max(q, k, keep) -> torch.Tensor:
    """The reference: the whole [b, h, s, s] logit matrix, masked by keep [b or 1, s, s], max per head."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(~keep[:, None], -math.inf)
    return logits.amax(dim=(0, 2, 3)).float()


@pytest.mark.parametrize("chunk", [attention._MAX_LOGIT_CHUNK, 40])  # 40: one query row at a time
def test_max_logits_equals_the_whole_logit_matrix_under_each_mask(monkeypatch, chunk):
    monkeypatch.setattr(attention, "_MAX_LOGIT_CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    b, s, d = 2, 12, 8
    q, k = torch.randn(b, 4, s, d, generator=g), torch.randn(b, 2, s, d, generator=g)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    causal = (j <= i)[None]
    torch.testing.assert_close(max_logits(q, k), _dense_max(q, k, causal))
    # A later key with a huge logit must not count: causal masking is what keeps it out.
    k2 = k.clone()
    k2[:, :, -1] = 100 * q[:, ::2, 0]
    got = max_logits(q, k2)
    torch.testing.assert_close(got, _dense_max(q, k2, causal))
    assert (got < 0.9 * _dense_max(q, k2, (j >= 0)[None])).any()
    doc = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3], dtype=torch.int32)
    for window in (0, 3):
        boolean = _bool_mask(doc, window, s, CPU)
        want = _dense_max(q, k, boolean[:, 0])
        torch.testing.assert_close(max_logits(q, k, boolean), want)
        # FlexAttention's block mask (the CUDA path) is read through its mask_mod: the same rule.
        torch.testing.assert_close(max_logits(q, k, _block_mask(doc, window, s, CPU)), want)
    window_only = _bool_mask(None, 3, s, CPU)
    torch.testing.assert_close(max_logits(q, k, window_only), _dense_max(q, k, window_only[:, 0]))
    # bf16 (the products in the kernel's dtype): the maximum within bf16's rounding, returned in fp32.
    low = max_logits(q.bfloat16(), k.bfloat16())
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, _dense_max(q, k, causal), rtol=2e-2, atol=2e-2)


def _inputs(model, tokens) -> dict[int, tuple]:
    """Each attention layer's inputs in a forward on `tokens` (to recompute a layer's logits on the same batch:
    a clip of layer 0 changes what reaches layer 1)."""
    seen: dict[int, tuple] = {}
    layers = attention_layers([model])
    hooks = [
        m.register_forward_pre_hook(lambda _, a, kw, i=i: seen.setdefault(i, (a, kw)), with_kwargs=True)
        for i, m in layers.items()
    ]
    model(tokens)
    for h in hooks:
        h.remove()
    return seen


def _measure(model, inputs: dict[int, tuple]) -> dict[int, torch.Tensor]:
    """Every layer's per-head maximum of a training forward of each attention layer on its `inputs`."""
    clip = QKClip(attention_layers([model]), model.args, tau=1.0)
    for i, m in clip.layers.items():
        m(*inputs[i][0], **inputs[i][1])
    return {i: m.max_logits.clone() for i, m in clip.layers.items()}


def _craft(n_kv_heads: int):
    """A 2-layer model whose heads have very different logit ranges: some query and key rows scaled up."""
    model = tiny(n_heads=4, n_kv_heads=n_kv_heads).train()
    hd = model.args.head_dim
    with torch.no_grad():
        a0, a1 = model.layers["0"].attention, model.layers["1"].attention
        a0.wq.weight[0 * hd : 1 * hd] *= 30  # layer 0: head 0 far over
        a0.wq.weight[3 * hd : 4 * hd] *= 12  # layer 0: head 3 over
        a1.wk.weight[0:hd] *= 25  # layer 1: key head 0 (with GQA, the group of query heads 0 and 1) over
        a1.wq.weight[2 * hd : 3 * hd] *= 3  # layer 1: head 2 up, but under τ
    return model


@pytest.mark.parametrize("n_kv_heads", [4, 2])  # multi-head (Kimi K2's sqrt split) and grouped-query
def test_qk_clip_rescales_exactly_the_heads_over_tau_to_tau(n_kv_heads):
    model = _craft(n_kv_heads)
    tokens = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    inputs = _inputs(model, tokens)
    before = _measure(model, inputs)
    table = torch.stack([before[0], before[1]])
    tau = 0.5 * (table.max() + table.median()).item()  # between the crafted heads and the others
    over = table > tau
    assert 2 <= over.sum() < over.numel() - 2, table  # the crafted case clips some heads and spares others
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}

    clip = QKClip(attention_layers([model]), model.args, tau)
    model(tokens)
    clip.step()
    assert clip.metrics() == {"max_attn_logit": table.max().item(), "qk_clipped_heads": int(over.sum())}
    after = _measure(model, inputs)  # each layer on the inputs it had
    hd, group = model.args.head_dim, 4 // n_kv_heads
    for i in (0, 1):
        att = model.layers[str(i)].attention
        for h in range(4):
            rows = slice(h * hd, (h + 1) * hd)
            if over[i, h]:
                # Rescaled to τ: the same batch now peaks at τ, up to fp32 rounding of the scaled weights.
                torch.testing.assert_close(after[i][h], torch.tensor(tau), rtol=2e-6, atol=0)
            else:
                assert torch.equal(after[i][h], before[i][h])  # untouched: the same logits, bit for bit
                assert torch.equal(att.wq.weight[rows], weights[f"layers.{i}.attention.wq.weight"][rows])
        for kv in range(n_kv_heads):
            rows = slice(kv * hd, (kv + 1) * hd)
            old = weights[f"layers.{i}.attention.wk.weight"][rows]
            # A key changes only when every query head reading it is clipped (then by sqrt of the mildest γ).
            if over[i, kv * group : (kv + 1) * group].all():
                assert (att.wk.weight[rows].norm() < old.norm()).item()
            else:
                assert torch.equal(att.wk.weight[rows], old)
    # Only W_q and W_k change.
    for name, p in model.named_parameters():
        if ".wq." not in name and ".wk." not in name:
            assert torch.equal(p, weights[name]), name


def test_head_scales_give_each_head_its_gamma_and_kimi_split_without_groups():
    gamma = torch.tensor([0.25, 0.5, 1.0, 0.64])
    q, k = head_scales(gamma, 4)
    torch.testing.assert_close(q, gamma.sqrt())
    torch.testing.assert_close(k, gamma.sqrt())
    q, k = head_scales(gamma, 2)  # groups (0.25, 0.5) both clipped; (1.0, 0.64): head 2 under τ keeps the key
    torch.testing.assert_close(k, torch.tensor([0.5**0.5, 1.0]))
    torch.testing.assert_close(q * k.repeat_interleave(2), gamma)
    assert (q <= 1).all()


def test_skipped_step_and_evaluation_neither_clip_nor_count():
    model = _craft(2)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    clip = QKClip(attention_layers([model]), model.args, tau=1e-3)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(tokens)
    clip.step(applied=False)  # a skipped step: weights as they were, the maxima reset
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert all((m.max_logits == -math.inf).all() for m in clip.layers.values())
    model.eval()
    with torch.no_grad():
        model(tokens)  # evaluation measures nothing
    assert all((m.max_logits == -math.inf).all() for m in clip.layers.values())


def test_off_by_default_measures_nothing():
    pcfg = ParallelConfig()
    _, opts, _ = build_core(tiny(), ParallelDims.from_config(pcfg, 1), pcfg, TrainingConfig(), OptimizerConfig(),
                            device=CPU, n_microbatches=1)  # fmt: skip
    assert opts.qk_clip is None
    _, opts, _ = build_core(tiny(), ParallelDims.from_config(pcfg, 1), pcfg, TrainingConfig(),
                            OptimizerConfig(qk_clip=50.0), device=CPU, n_microbatches=1)  # fmt: skip
    assert opts.qk_clip is not None and len(opts.qk_clip.layers) == 2


def test_validate_refuses_what_qk_clip_cannot_measure():
    cfg = Config()
    assert qk_clip_problems(cfg) == []
    cfg.optimizer.qk_clip = -1.0
    assert "must be > 0" in qk_clip_problems(cfg)[0]
    cfg.optimizer.qk_clip = 100.0
    assert qk_clip_problems(cfg) == []
    cfg.parallel.cp, cfg.training.compile, cfg.fault_tolerance.enabled = 2, True, True
    cp, ft, compiled = qk_clip_problems(cfg)
    assert "parallel.cp > 1" in cp and "ring attention" in cp
    assert "fault_tolerance.enabled" in ft and "replica group" in ft
    assert "training.compile" in compiled


# 2**25: every query in one chunk; 512: one query per chunk; 2000: three, the last chunk shorter
@pytest.mark.parametrize("chunk", [2**25, 512, 2000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_memory_estimate_holds_what_max_logits_holds_at_once(monkeypatch, chunk, dtype):
    """QK-clip's measuring memory as the estimate counts it: max_logits_bytes bounds the bytes max_logits holds
    alive at once (its chunk of scores, their fp32 copy under bf16, the masks), within 10%."""
    monkeypatch.setattr(attention, "_MAX_LOGIT_CHUNK", chunk)
    b, hq, hkv, s, elt = 2, 4, 2, 64, torch.finfo(dtype).bits // 8
    q, k = torch.randn(b, hq, s, 8, dtype=dtype), torch.randn(b, hkv, s, 8, dtype=dtype)
    with LiveBytes() as seen:
        max_logits(q, k)
    estimate = max_logits_bytes(b, hq, s, elt)
    assert seen.peak <= estimate < 1.1 * seen.peak, (seen.peak, estimate)


def test_the_memory_estimate_adds_it_with_each_ranks_heads_when_qk_clip_is_on():
    """per_rank_bytes (validate's memory check and the planner) adds max_logits_bytes over the rank's tp heads."""
    args = tiny().args
    t = TrainingConfig(micro_batch=2)
    tp2 = ParallelConfig(data_parallel="fsdp", tp=2)
    off = per_rank_bytes(args, tp2, t, 128, 4, precision="bf16")
    on = per_rank_bytes(args, tp2, t, 128, 4, precision="bf16", qk_clip=True)
    assert on["activations"] - off["activations"] == max_logits_bytes(2, args.n_heads // 2, 128, 2)
    assert on["total"] - off["total"] == on["activations"] - off["activations"]
