"""Muon on one process (scaletrain/optim/muon.py): Newton-Schulz against the SVD's orthogonal factor, the update
against torch.optim.Muon's, which parameters go to Muon and which stay on AdamW, the state round trip, how the
distributed step splits the matrices over ranks, and the planner's count of Muon's cost."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from scaletrain.config import Config, MemoryConfig, OptimizerConfig, ParallelConfig, TrainingConfig
from scaletrain.config.io import to_dict
from scaletrain.models import ModelArgs
from scaletrain.optim import muon
from scaletrain.optim.muon import Muon, hidden_matrices, newton_schulz, update_scale
from scaletrain.optim.optimizers import Optimizers, build_optimizer
from scaletrain.planning.estimators.hardware import GPUS
from scaletrain.planning.estimators.muon import hidden_shapes
from scaletrain.planning.estimators.time import step_time
from scaletrain.run.resume import resume_problems
from scaletrain.validate import validate
from tests.fixtures import tiny

CPU = torch.device("cpu")
# A quintic that converges to 1 on (0, 1] (15x - 10x^3 + 3x^5)/8: with enough steps, exactly U V^T.
CONVERGENT = (15 / 8, -10 / 8, 3 / 8)


def _with_spectrum(rows: int, cols: int, s: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A matrix U diag(s) V^T with random orthonormal U, V; returns it, U and V."""
    g = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=g, dtype=torch.float64))
    return (u * s) @ v.T, u, v


@pytest.mark.parametrize("shape", [(48, 96), (96, 48), (40, 40)])
def test_newton_schulz_with_enough_steps_gives_the_svd_orthogonal_factor(shape):
    # Well conditioned (singular values 0.2..1 before normalising): 30 steps of the convergent quintic land on
    # U V^T within 1e-5 in fp32; a wrong transpose or normalisation lands far off.
    k = min(shape)
    g, u, v = _with_spectrum(*shape, torch.linspace(0.2, 1.0, k, dtype=torch.float64))
    out = newton_schulz(g.float(), steps=30, coefficients=CONVERGENT)
    assert out.dtype == torch.float32 and out.shape == shape
    torch.testing.assert_close(out.double(), u @ v.T, rtol=0, atol=1e-5)


@pytest.mark.parametrize("shape", [(64, 128), (128, 64)])
def test_ns5_keeps_the_singular_vectors_and_puts_singular_values_in_its_band(shape):
    # NS5 (Jordan's coefficients, 5 steps) promises U S' V^T: the singular vectors of G kept exactly, every
    # singular value s with s/|G|_F >= 0.0043 mapped into [0.68, 1.21] (the scalar map's range there). The
    # spectrum spans 0.005..1 of |G|_F: three decades, as a gradient's does.
    k = min(shape)
    s = torch.logspace(math.log10(0.005), 0, k, dtype=torch.float64)
    g, u, v = _with_spectrum(*shape, s)
    g = g / g.norm() * 3.0  # any scale: NS normalises by the Frobenius norm first
    out = newton_schulz(g.float()).double()
    core = u.T @ out @ v  # diag(S') if the singular vectors are G's
    assert (core - torch.diag(torch.diagonal(core))).abs().max() < 1e-5
    assert (s * 3.0 / g.norm() >= 0.0043).all()
    sv = torch.diagonal(core)
    assert 0.68 <= sv.min() and sv.max() <= 1.21, (sv.min().item(), sv.max().item())
    # Far from the exact factor: this is what NS5 trades for its speed.
    assert (out - u @ v.T).abs().max() > 1e-2


def test_newton_schulz_of_a_stack_is_per_matrix_and_bitwise():
    # MoE experts [E, A, B]: each expert orthogonalised alone, with the very bits of the 2-D call, so that a
    # layout holding some experts whole computes what the single process does.
    g = torch.randn(3, 24, 40, generator=torch.Generator().manual_seed(2))
    out = newton_schulz(g)
    for i in range(3):
        assert torch.equal(out[i], newton_schulz(g[i]))


def test_update_scale_matches_adamw_rms():
    # Moonlight: an orthogonal update's RMS is 1/sqrt(max(A, B)); 0.2 sqrt(max(A, B)) brings it to AdamW's ~0.2.
    w = torch.linalg.qr(torch.randn(256, 64))[0]  # orthonormal columns: all singular values 1
    rms = (w * update_scale(w.shape, "match_rms_adamw")).pow(2).mean().sqrt()
    assert rms.item() == pytest.approx(0.2, rel=1e-5)
    assert update_scale(torch.Size([256, 64]), "original") == 2.0


def test_hidden_matrices_leave_embedding_head_and_norms_to_adamw():
    model = tiny()
    cfg = OptimizerConfig(name="muon", lr=1e-3, weight_decay=0.1, muon_lr=0.02, muon_weight_decay=0.05)
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, Muon)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = [names[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]]
    adamw = [names[id(p)] for g in opt.param_groups if not g["muon"] for p in g["params"]]
    assert sorted(muon) == sorted(names[id(p)] for p in hidden_matrices(model))
    assert "tok_embeddings.weight" in adamw and "output.weight" in adamw
    assert all(".w" in n for n in muon) and len(muon) == 2 * 7  # wq wk wv wo w1 w2 w3 per block
    (group,) = [g for g in opt.param_groups if g["muon"]]
    assert (group["lr"], group["weight_decay"]) == (0.02, 0.05)
    assert not opt.param_groups[0]["muon"] and opt.param_groups[0]["lr"] == 1e-3  # what Optimizers.lr reports
    # Unset: the Muon group takes AdamW's lr and decay (match_rms_adamw makes them transfer).
    opt = build_optimizer(model, OptimizerConfig(name="muon", lr=1e-3, weight_decay=0.1))
    (group,) = [g for g in opt.param_groups if g["muon"]]
    assert (group["lr"], group["weight_decay"]) == (1e-3, 0.1)


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_steps_as_torch_optim_muon(nesterov):
    # torch.optim.Muon runs Newton-Schulz in bf16 (ours in fp32): the same update to bf16's precision over three
    # steps, with decay, momentum and the match_rms_adamw scale. A different buffer rule or scale is off by 10%+.
    torch.manual_seed(0)
    w = torch.randn(32, 48)
    ours, theirs = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
    a = Muon([{"params": [ours], "muon": True}], adjust_lr="match_rms_adamw", **kw)
    b = torch.optim.Muon([theirs], adjust_lr_fn="match_rms_adamw", **kw)
    for _ in range(3):
        grad = torch.randn(32, 48)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        a.step()
        b.step()
    moved = (theirs - w).abs().max()
    assert (ours - theirs).abs().max() < 0.02 * moved
    torch.testing.assert_close(a.state[ours]["momentum_buffer"], b.state[theirs]["momentum_buffer"])


def test_adamw_parameters_train_as_under_plain_adamw():
    # The AdamW part of Muon is torch's AdamW on the same groups: after one step from the same weights and batch
    # (the same gradients), the embedding, head and norms are bit for bit what optimizer.name adamw gives them;
    # the hidden matrices are not.
    cfgs = [OptimizerConfig(name=n, lr=1e-2, warmup_steps=0) for n in ("adamw", "muon")]
    models = [tiny(), tiny()]
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    for m, c in zip(models, cfgs):
        opts = Optimizers([m], lambda part, c=c: build_optimizer(part, c), c, 10)
        m(x).float().logsumexp(-1).mean().backward()
        opts.step()
    adamw, muon = (dict(m.named_parameters()) for m in models)
    for name in ("tok_embeddings.weight", "output.weight", "norm.weight", "layers.0.attention_norm.weight"):
        assert torch.equal(adamw[name], muon[name]), name
    assert not torch.equal(adamw["layers.0.attention.wq.weight"], muon["layers.0.attention.wq.weight"])


def test_muon_state_round_trips_through_optimizers_state_dict():
    cfg = OptimizerConfig(name="muon", lr=1e-2, warmup_steps=0)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def trained(steps: int):
        model = tiny()
        opts = Optimizers([model], lambda part: build_optimizer(part, cfg), cfg, 10)
        for _ in range(steps):
            model(x).float().logsumexp(-1).mean().backward()
            opts.step()
        return model, opts

    model, opts = trained(3)
    sd = copy.deepcopy(opts.state_dict())  # its tensors are the live moments: the load must not share them
    assert any(k.endswith("attention.wq.weight.momentum_buffer") for k in sd)
    assert any(k.endswith("tok_embeddings.weight.exp_avg") for k in sd)
    fresh, fresh_opts = trained(0)
    fresh.load_state_dict(model.state_dict())
    fresh_opts.load_state_dict(sd)
    for m, o in ((model, opts), (fresh, fresh_opts)):
        m(x).float().logsumexp(-1).mean().backward()
        o.step()
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name


def test_a_resume_refuses_another_optimizer_and_takes_muon_settings_like_the_lr():
    # The checkpoint holds one optimizer's state (AdamW's moments or Muon's buffers): switching is refused; Muon's
    # lr, like optimizer.lr, may change with run.accept_changes.
    saved = to_dict(Config())
    switched = Config()
    switched.optimizer.name = "muon"
    (problem,) = resume_problems(saved, to_dict(switched), ["optimizer"])
    assert problem.startswith("optimizer.name was 'adamw'") and "cannot continue" in problem
    muon = Config()
    muon.optimizer.name = "muon"
    faster = Config()
    faster.optimizer.name, faster.optimizer.muon_lr = "muon", 0.01
    assert "--run.accept_changes optimizer.muon_lr" in resume_problems(to_dict(muon), to_dict(faster), [])[0]
    assert resume_problems(to_dict(muon), to_dict(faster), ["optimizer.muon_lr"]) == []


def test_validate_names_bad_muon_settings_and_refuses_offload():
    cfg = Config()
    cfg.optimizer.name, cfg.optimizer.muon_lr, cfg.optimizer.muon_momentum = "muon", 0.0, 1.0
    cfg.memory.optimizer_offload = True
    problems = validate(cfg, 1, check_run_dir=False)
    assert any(p.startswith("optimizer.muon_lr must be > 0") for p in problems)
    assert any(p.startswith("optimizer.muon_momentum must be in [0, 1)") for p in problems)
    assert any(p.startswith("optimizer.name muon with memory.optimizer_offload is refused") for p in problems)
    assert not [p for p in validate(Config(), 1, check_run_dir=False) if "muon" in p]


def test_bucket_owners_split_the_newton_schulz_flops_evenly():
    # The 30M benchmark model's 56 matrices over 4 ranks (issue 40): buckets of about BUCKET_BYTES in order, each
    # matrix owned by one rank, each rank's FLOPs within 10% of a quarter (by turns: 4 ranks took 14 matrices each
    # whatever their size).
    args = ModelArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_hidden=1536, vocab_size=512)
    jobs = [muon.Job(torch.empty(s, device="meta"), torch.empty(0), 1.0) for s in hidden_shapes(args)]
    buckets = muon._buckets(jobs, 4, 5)
    assert [j for b in buckets for j in b] == jobs and len(buckets) > 1
    biggest = max(4 * j.p.numel() for j in jobs)
    assert all(sum(4 * j.p.numel() for j in b) < muon.BUCKET_BYTES + biggest for b in buckets)
    load = [sum(muon.newton_schulz_flops(j.p.shape, 5) for j in jobs if j.owner == r) for r in range(4)]
    assert max(load) <= 1.1 * sum(load) / 4, load


@pytest.mark.parametrize("moe", [False, True])
def test_the_planner_counts_the_matrices_muon_steps_and_its_share_falls_with_tokens(moe):
    model = tiny(n_experts=4, top_k=2, moe_hidden=32, first_dense=1, shared_experts=1) if moe else tiny()
    assert sorted(hidden_shapes(model.args)) == sorted(tuple(p.shape) for p in hidden_matrices(model))
    args = ModelArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_hidden=1536, vocab_size=512)

    def ratio(tokens: int) -> tuple[float, dict]:
        t = {name: step_time(args, ParallelConfig(data_parallel="fsdp"), TrainingConfig(micro_batch=8),
                             MemoryConfig(), 128, 64, GPUS["h100"], global_batch=tokens // 128,
                             optimizer=OptimizerConfig(name=name)) for name in ("adamw", "muon")}  # fmt: skip
        return t["muon"]["step_time_s"] / t["adamw"]["step_time_s"], t

    small, t = ratio(2048 * 64)
    large, _ = ratio(2**20)
    assert t["adamw"]["muon_s"] == 0 < t["muon"]["muon_s"]
    assert t["muon"]["step_time_s"] == pytest.approx(t["adamw"]["step_time_s"] + t["muon"]["muon_s"])
    assert 1 < large < small
