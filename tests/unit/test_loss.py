"""The loss that never holds the whole logits (issue 40): the fused chunked function and the model's forward with
targets give today's loss and gradients (fp32 rounding; bf16 rounding under autocast), a small vocabulary is
today's computation bit for bit, and no tensor of [tokens x vocab] elements is ever made. model.loss = "whole"
trains as the chunks do, and the planner's term for each mode is what the loss holds alive at once."""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from scaletrain.config import ParallelConfig, TrainingConfig
from scaletrain.errors import ConfigError
from scaletrain.models import ModelArgs, build_model, cross_entropy
from scaletrain.models import loss as loss_module
from scaletrain.models.loss import (
    COMPILED_LOSS_LOGITS,
    WHOLE_LOSS_BYTES_PER_LOGIT,
    linear_cross_entropy,
    loss_activation_bytes,
    output_loss,
)
from scaletrain.planning.estimators.memory import per_rank_bytes
from scaletrain.validate import load_config
from tests.fixtures import LiveBytes
from tests.helpers import ROOT

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=96, max_seq_len=16)


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor with a vocabulary-sized dimension (logits, their softmax or gradient) that
    an op makes while active, forward and backward, leaving out the weight-shaped ones (tables, their gradients,
    transposes); and the shapes of all it made."""

    def __init__(self, vocab: int, weight_shape: tuple[int, ...] = ()):
        super().__init__()
        self.vocab, self.weight_shape, self.largest, self.shapes = vocab, weight_shape, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.add(tuple(t.shape))
            if (
                isinstance(t, torch.Tensor)
                and self.vocab in t.shape
                and sorted(t.shape) != sorted(self.weight_shape)
            ):
                self.largest = max(self.largest, t.numel())
        return out


def _data(tokens=37, dim=16, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, dim, generator=g, dtype=torch.float64).float().requires_grad_()
    w = (0.3 * torch.randn(vocab, dim, generator=g)).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=g)
    return h, w, t


def test_fused_chunks_give_the_whole_loss_and_gradients():
    h, w, t = _data()
    ref = F.cross_entropy(h @ w.T, t, reduction="sum")
    gh, gw = torch.autograd.grad(ref / t.numel(), (h, w))
    for chunk in (1, 5, 36, 37, 100):
        got = linear_cross_entropy(h, w, t, chunk)
        ch, cw = torch.autograd.grad(got / t.numel(), (h, w))
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
        torch.testing.assert_close(ch, gh, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(cw, gw, rtol=1e-5, atol=1e-7)


def test_fused_under_bf16_autocast_is_as_exact_as_autocast_linear():
    """The same bf16 logits and fp32 softmax, so the same loss; the gradients' bf16 matmuls round in another order
    (fp32 sums over the chunks): each is no farther from the exact gradient (fp64 of the bf16-rounded inputs)
    than autocast's."""
    h, w, t = _data(tokens=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy((h @ w.T).float(), t, reduction="sum")
        got = linear_cross_entropy(h, w, t, 16)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=0)
    ref_grads = torch.autograd.grad(ref, (h, w))
    grads = torch.autograd.grad(got, (h, w))
    hd, wd = (v.detach().bfloat16().double().requires_grad_() for v in (h, w))
    exact = torch.autograd.grad(F.cross_entropy(hd @ wd.T, t, reduction="sum"), (hd, wd))
    for g, r, e, v in zip(grads, ref_grads, exact, (h, w), strict=True):
        assert g.dtype == v.dtype
        assert (g.double() - e).abs().max() <= (r.double() - e).abs().max()


def _grads(model, x, y, with_targets: bool):
    model.zero_grad(set_to_none=True)
    if with_targets:
        loss = model(x, targets=y) / y.numel()
    else:
        loss = cross_entropy(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _batch(b=4):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, ARGS.vocab_size, (b, ARGS.max_seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def test_one_chunk_is_todays_loss_bit_for_bit():
    model = build_model(ARGS, 0, "cpu")
    x, y = _batch()
    ref_loss, ref = _grads(model, x, y, with_targets=False)
    loss, got = _grads(model, x, y, with_targets=True)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(got[n], ref[n]) for n in ref)


def test_forward_with_targets_never_holds_the_whole_logits(monkeypatch):
    """Chunks of 8 tokens: every tensor of the step (forward and backward) is at most one chunk's logits, and the
    loss and every gradient are today's within fp32 rounding."""
    monkeypatch.setattr(loss_module, "LOGITS_CHUNK_ELEMENTS", 8 * ARGS.vocab_size)
    model = build_model(ARGS, 0, "cpu")
    x, y = _batch()
    ref_loss, ref = _grads(model, x, y, with_targets=False)
    with LargestTensor(ARGS.vocab_size, (ARGS.vocab_size, ARGS.dim)) as mode:
        loss, got = _grads(model, x, y, with_targets=True)
    assert mode.largest <= 8 * ARGS.vocab_size < y.numel() * ARGS.vocab_size
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-7, msg=n)


def test_checkpointed_chunks_for_an_output_with_hooks(monkeypatch):
    """An output layer that cannot be fused (here: it has a forward hook, as tensor parallel's has) runs each chunk
    under checkpoint: the same loss and gradients, no whole logits, the hook seen on every chunk and recompute."""
    monkeypatch.setattr(loss_module, "LOGITS_CHUNK_ELEMENTS", 8 * ARGS.vocab_size)
    model = build_model(ARGS, 0, "cpu")
    calls = []
    model.output.register_forward_hook(lambda m, a, out: calls.append(out.shape))
    x, y = _batch()
    h = torch.randn(4, ARGS.max_seq_len, ARGS.dim, requires_grad=True)
    ref = cross_entropy(model.output(h), y, reduction="sum")
    (gh,) = torch.autograd.grad(ref, h)
    calls.clear()
    with LargestTensor(ARGS.vocab_size, (ARGS.vocab_size, ARGS.dim)) as mode:
        got = output_loss(model.output, h, y)
        (ch,) = torch.autograd.grad(got, h)
    assert mode.largest <= 8 * ARGS.vocab_size
    assert len(calls) == 2 * 8  # 64 tokens in chunks of 8: each forward once, again in backward
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(ch, gh, rtol=1e-5, atol=1e-7)


def test_planner_counts_one_chunk_not_the_logits():
    tokens, vocab, dim = 4096, 128_256, 128
    whole = tokens * vocab * 4
    assert loss_activation_bytes(tokens, vocab, dim) <= whole / 2
    assert (
        loss_activation_bytes(64, 320, dim) == 64 * 320 * WHOLE_LOSS_BYTES_PER_LOGIT
    )  # one chunk is the whole


def test_without_autograd_only_the_loss_is_computed():
    """Evaluation: the same loss, one chunk's logits at a time, and no gradient buffers (none of the weight's or
    the hidden states' shape is made)."""
    h, w, t = _data(tokens=40)
    with torch.no_grad():
        ref = F.cross_entropy(h @ w.T, t, reduction="sum")
        with LargestTensor(50, (50, 16)) as mode:
            got = linear_cross_entropy(h, w, t, 8)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    assert mode.largest <= 8 * 50 and not got.requires_grad
    assert (50, 16) not in mode.shapes and (40, 16) not in mode.shapes


# (model.loss, tokens) on a 2000-word vocabulary in chunks of 32 tokens: the whole loss, one chunk (the whole loss's
# computation), four chunks (the fused path).
@pytest.mark.parametrize("mode,tokens", [("whole", 128), ("chunked", 32), ("chunked", 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_planners_loss_term_is_what_the_loss_holds_at_once(monkeypatch, mode, tokens, dtype):
    """loss_activation_bytes against the bytes a forward and backward of the loss (output layer included) hold
    alive at once, in fp32 and under bf16 autocast: within 5% (bf16 also holds autocast's 2-byte copies of the
    output weight and the hidden states, which the planner counts with the weights; 3% here)."""
    dim, vocab = 4, 2000
    monkeypatch.setattr(loss_module, "LOGITS_CHUNK_ELEMENTS", 32 * vocab)
    torch.manual_seed(0)
    output = nn.Linear(dim, vocab, bias=False)
    h = torch.randn(1, tokens, dim, requires_grad=True)
    y = torch.randint(0, vocab, (1, tokens))
    with LiveBytes() as seen:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = output_loss(output, h, y, mode)
        loss.backward()
    term = loss_activation_bytes(tokens, vocab, dim, mode=mode)
    assert abs(seen.peak / term - 1) <= 0.05, (seen.peak, term)


def test_the_memory_model_charges_the_loss_model_loss_names():
    """per_rank_bytes's logits part is loss_activation_bytes of the micro-batch in the mode ModelArgs carries."""
    args = dataclasses.replace(ARGS, vocab_size=128_256, dim=256)
    t, p = TrainingConfig(micro_batch=2), ParallelConfig()
    parts = {
        m: per_rank_bytes(dataclasses.replace(args, loss=m), p, t, 1024, 1)
        for m in ("chunked", "whole", "whole_compiled")
    }
    for m, part in parts.items():
        assert part["logits"] == loss_activation_bytes(2 * 1024, args.vocab_size, args.dim, mode=m, elt=4)
    assert parts["whole"]["logits"] == 2 * 1024 * 128_256 * WHOLE_LOSS_BYTES_PER_LOGIT
    assert parts["whole_compiled"]["logits"] == 2 * 1024 * 128_256 * 2 * 4  # fp32: two 4-byte logits
    bf16 = per_rank_bytes(dataclasses.replace(args, loss="whole_compiled"), p, t, 1024, 1, precision="bf16")
    assert bf16["logits"] == 2 * 1024 * 128_256 * 2 * 2
    assert parts["whole"]["total"] > parts["chunked"]["total"]


def test_whole_loss_trains_as_the_chunked_loss(monkeypatch):
    """model.loss = "whole" and "whole_compiled" against chunks of 8 tokens on one process: three AdamW steps give
    the same losses and gradients within fp32 rounding, and only the whole mode makes the [tokens x vocab] logits
    (the compiled one runs its own kernels, unseen by a dispatch mode, and so is run without one)."""
    monkeypatch.setattr(loss_module, "LOGITS_CHUNK_ELEMENTS", 8 * ARGS.vocab_size)
    x, y = _batch()
    runs = {}
    for mode in ("chunked", "whole", "whole_compiled"):
        model = build_model(dataclasses.replace(ARGS, loss=mode), 0, "cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, grads = [], []
        seen = LargestTensor(ARGS.vocab_size, (ARGS.vocab_size, ARGS.dim))
        with seen if mode != "whole_compiled" else contextlib.nullcontext():
            for _ in range(3):
                loss, g = _grads(model, x, y, with_targets=True)
                losses.append(loss)
                grads.append(g)
                opt.step()
        runs[mode] = losses, grads, seen.largest
    assert runs["chunked"][2] <= 8 * ARGS.vocab_size and runs["whole"][2] == y.numel() * ARGS.vocab_size
    for mode in ("whole", "whole_compiled"):
        for a, b in zip(runs[mode][0], runs["chunked"][0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0, msg=mode)
        for ga, gb in zip(runs[mode][1], runs["chunked"][1], strict=True):
            for n in ga:
                torch.testing.assert_close(ga[n], gb[n], rtol=1e-5, atol=1e-6, msg=f"{mode} {n}")


# What a compiled loss holds, read from the kernel (a dispatch mode does not see inside compiled kernels): a fresh
# process, glibc's mmap threshold pinned as the workers pin it (each logits-sized buffer its own mapping, unmapped
# when freed), compiled and run once on the shape, then VmHWM reset and one forward and backward measured.
_PEAK = """
import sys, torch
from torch import nn
from scaletrain.hardware import pin_mmap_threshold
from scaletrain.models.loss import output_loss
pin_mmap_threshold()
torch.set_num_threads(1)
tokens, vocab, dtype = int(sys.argv[1]), int(sys.argv[2]), getattr(torch, sys.argv[3])
output = nn.Linear(4, vocab, bias=False)
h = torch.randn(1, tokens, 4, requires_grad=True)
y = torch.randint(0, vocab, (1, tokens))
def step():
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        loss = output_loss(output, h, y, "whole_compiled")
    loss.backward()
def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
step()
base = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")
step()
print(status("VmHWM:") - base)
"""


@pytest.mark.parametrize("dtype,elt", [("float32", 4), ("bfloat16", 2)])
def test_the_compiled_loss_holds_two_logits(dtype, elt):
    """model.loss = "whole_compiled": the kernel's peak over a forward and backward of 2048 tokens x 16,384 words
    (0.13-0.27 GB) is the planner's term, 2 logits of the compute dtype, within 5% (eager holds 12 bytes a logit:
    a compile that fell back to eager fails this by 3-6x)."""
    tokens, vocab = 2048, 16_384
    out = subprocess.run([sys.executable, "-c", _PEAK, str(tokens), str(vocab), dtype],
                         capture_output=True, text=True, check=True, cwd=ROOT)  # fmt: skip
    peak = int(out.stdout.split()[-1])
    term = loss_activation_bytes(tokens, vocab, 4, mode="whole_compiled", elt=elt)
    assert term == COMPILED_LOSS_LOGITS * elt * tokens * vocab
    assert abs(peak / term - 1) <= 0.05, (peak, term)


def test_the_compiled_loss_under_tensor_parallel_is_refused_with_the_reason():
    """whole_compiled runs plain logits only: under tp the logits are DTensors of the vocabulary-parallel loss,
    which is not compiled here; the check refuses it and names what to use. Without tp it is accepted."""
    tp = ["--model.loss", "whole_compiled", "--parallel.tp", "2", "--parallel.data_parallel", "fsdp"]
    with pytest.raises(
        ConfigError, match="model.loss 'whole_compiled' with parallel.tp > 1 is refused.*use whole"
    ):
        load_config(None, tp, world_size=2, check_run_dir=False)
    load_config(None, ["--model.loss", "whole_compiled"], world_size=1, check_run_dir=False)
