"""The single-process reference every parallel layout is compared with (llm.c's habit: one reference run,
everything else checked against it). Each rank recomputes it locally: it is tiny and deterministic."""

from __future__ import annotations

import contextlib
import copy

import torch

from scaletrain.config import OptimizerConfig
from scaletrain.models import ModelArgs, Transformer, build_meta_model
from scaletrain.optim import build_lr_scheduler, build_optimizer
from scaletrain.step import train_step

OPT = OptimizerConfig(lr=3e-3, warmup_steps=2, schedule="cosine", weight_decay=0.1)
STEPS = 10


def tiny_args(**kw) -> ModelArgs:
    base = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=128, max_seq_len=32)
    return ModelArgs(**{**base, **kw})


def full_model(args: ModelArgs, seed: int = 0) -> Transformer:
    """The model materialised on CPU with a fixed seed: the same weights on every rank and in every layout."""
    model = build_meta_model(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def global_batches(args: ModelArgs, global_batch: int = 8, steps: int = STEPS, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, args.vocab_size, (global_batch, args.max_seq_len + 1), generator=g)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def reference_run(model: Transformer, batches, micro_batch: int = 4, grad_clip: float = 1.0) -> dict:
    """Train a copy on the full global batches; return per-step losses, grad norms and the final weights."""
    model = copy.deepcopy(model)
    opt = build_optimizer(model, OPT, torch.device("cpu"))
    sched = build_lr_scheduler(opt, OPT, len(batches))
    losses, norms = [], []
    for x, y in batches:
        loss, norm = train_step(
            model,
            opt,
            sched,
            x,
            y,
            micro_batch=micro_batch,
            autocast=contextlib.nullcontext(),
            grad_clip=grad_clip,
        )
        losses.append(loss.item())
        norms.append(norm.item())
    return {
        "losses": losses,
        "grad_norms": norms,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def assert_close_run(
    got_losses, got_norms, got_state: dict | None, ref: dict, rtol: float = 1e-5, atol_params: float = 1e-5
) -> None:
    """Losses and grad norms within rtol of the reference at every step; final parameters equal."""
    assert len(got_losses) == len(ref["losses"])
    for i, (a, b) in enumerate(zip(got_losses, ref["losses"])):
        assert abs(a - b) <= rtol * abs(b), f"step {i + 1}: loss {a} vs reference {b}"
    for i, (a, b) in enumerate(zip(got_norms, ref["grad_norms"])):
        assert abs(a - b) <= rtol * abs(b), f"step {i + 1}: grad norm {a} vs reference {b}"
    if got_state is not None:
        for k, v in ref["state"].items():
            assert k in got_state, f"missing parameter {k}"
            torch.testing.assert_close(
                got_state[k], v, rtol=0, atol=atol_params, msg=lambda m, k=k: f"{k}: {m}"
            )
