"""Document masking, sliding-window attention and the kernel choice: each against an explicit reference."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from scaletrain.errors import ConfigError
from scaletrain.models.attention import (
    AttentionKernel,
    _block_mask,
    _bool_mask,
    attention_masks,
    causal_sdpa,
    document_ids,
    document_positions,
)
from scaletrain.models.llama import ModelArgs, Transformer
from scaletrain.models.loss import cross_entropy
from scaletrain.parallel.step import StepRunner
from scaletrain.validate import load_config

EOD = 3  # any id works; the byte tokenizer's is 256


def tiny(seed: int = 0, **kw) -> Transformer:
    args = ModelArgs(
        dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64, max_seq_len=32
    )
    for k, v in kw.items():
        setattr(args, k, v)
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    return model


def packed(lengths: list[int], seed: int = 1) -> torch.Tensor:
    """One row of documents of these lengths, each ending in EOD (the last one cut off, as a window does)."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for n in lengths:
        doc = torch.randint(4, 64, (n,), generator=g)
        doc[-1] = EOD
        parts.append(doc)
    row = torch.cat(parts)
    row[-1] = 5  # the window ends inside its last document
    return row[None]


def test_document_ids_and_positions_restart_after_each_eod():
    tokens = torch.tensor([[7, 8, EOD, 9, EOD, EOD, 4, 4], [EOD, 1, 2, 3 + 1, 5, 6, 7, 8]])
    doc = document_ids(tokens, EOD)
    # The eod belongs to the document it ends; the token after it starts the next one.
    assert doc.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert document_positions(doc).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]


@pytest.mark.parametrize("window", [0, 4])
def test_document_mask_equals_each_document_run_alone(window):
    lengths = [7, 11, 6]
    tokens = packed(lengths)
    model = tiny(window=window, window_every=2)
    with torch.no_grad():
        got = model(tokens, document_ids=document_ids(tokens, EOD))
        start = 0
        for n in lengths:
            alone = model(tokens[:, start : start + n])
            torch.testing.assert_close(got[:, start : start + n], alone, atol=1e-5, rtol=0)
            start += n
        # And it is a real change: without the mask the later documents see the earlier ones.
        assert not torch.allclose(model(tokens)[:, 7:], got[:, 7:], atol=1e-3)


def naive_attention(q, k, v, keep):
    """softmax(q k^T / sqrt(d) masked) v, with k/v heads repeated for grouped-query attention."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("backend", ["auto", "math", "flash"])
@pytest.mark.parametrize("window", [1, 3, 8])
def test_sliding_window_equals_dense_explicit_mask(backend, window):
    seq = 12
    q, k, v = torch.randn(2, 4, seq, 8), torch.randn(2, 2, seq, 8), torch.randn(2, 2, seq, 8)
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    keep = (j <= i) & (i - window < j)  # Mistral: query i sees i - window < j <= i
    mask = attention_masks(backend, {window}, None, seq, q.device)[window]
    assert torch.equal(mask[0, 0], keep)
    torch.testing.assert_close(AttentionKernel(backend)(q, k, v, mask), naive_attention(q, k, v, keep))


def test_window_at_least_seq_len_equals_plain_causal():
    tokens = torch.randint(0, 64, (2, 16))
    plain, windowed = tiny(), tiny(window=16)
    assert all(layer.attention.window == 16 for layer in windowed.layers.values())
    with torch.no_grad():
        torch.testing.assert_close(windowed(tokens), plain(tokens), atol=1e-6, rtol=1e-6)
        assert not torch.allclose(tiny(window=4)(tokens), plain(tokens), atol=1e-3)


def test_window_every_picks_layers_zero_k_2k():
    model = tiny(window=4, window_every=2)
    assert [layer.attention.window for layer in model.layers.values()] == [4, 0, 4]


def test_switches_off_is_bit_identical_to_causal_sdpa():
    tokens = torch.randint(0, 64, (2, 16))
    model = tiny()
    with torch.no_grad():
        got = model(tokens)
        for layer in model.layers.values():
            layer.attention.sdpa = causal_sdpa
        assert torch.equal(got, model(tokens))
    assert attention_masks("auto", {0}, None, 16, torch.device("cpu")) is None


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_block_mask_matches_bool_mask_in_flex_forward():
    """The FlexAttention rule (what CUDA runs) against the boolean one, in eager forward (CPU has no backward)."""
    tokens = packed([5, 9, 18])
    doc = document_ids(tokens, EOD)
    q, k, v = torch.randn(1, 4, 32, 8), torch.randn(1, 2, 32, 8), torch.randn(1, 2, 32, 8)
    for window in (0, 6):
        keep = _bool_mask(doc, window, 32, q.device)
        block = _block_mask(doc, window, 32, q.device)
        got = flex_attention(q, k, v, block_mask=block, enable_gqa=True)
        torch.testing.assert_close(got, naive_attention(q, k, v, keep), atol=1e-5, rtol=1e-5)


def test_document_mask_changes_the_step_loss_of_a_packed_batch():
    """The train step with data.document_mask: a different loss on a packed batch, the same without an eod."""
    rows = torch.cat([packed([9, 12, 12], seed=s) for s in range(4)])
    inputs, targets = rows[:, :-1], rows[:, 1:]

    def loss(eod_id, x, y):
        runner = StepRunner([tiny()], 2, contextlib.nullcontext(), 1.0, eod_id=eod_id)
        return runner.forward_backward(x, y)

    masked, plain = loss(EOD, inputs, targets), loss(None, inputs, targets)
    assert abs(masked.item() - plain.item()) > 1e-4
    # Check the masked loss by hand: the per-document reference summed over documents.
    model = tiny()
    ref = cross_entropy(model(inputs, document_ids=document_ids(inputs, EOD)), targets)
    torch.testing.assert_close(masked, ref.detach(), atol=1e-6, rtol=1e-6)
    no_eod = inputs.masked_fill(inputs == EOD, 7)
    assert torch.equal(loss(EOD, no_eod, targets), loss(None, no_eod, targets))


def problems(*overrides: str, world_size: int = 1) -> list[str]:
    try:
        load_config(None, list(overrides), world_size=world_size)
    except ConfigError as e:
        return e.problems
    return []


def test_validate_refuses_masks_with_context_parallel_and_document_mask_with_pipeline():
    cp = ["--parallel.cp", "2", "--parallel.dp_shard", "1"]
    assert any(
        "ring attention is causal-only" in p
        for p in problems(*cp, "--data.document_mask", "true", world_size=2)
    )
    assert any(
        "ring attention is causal-only" in p for p in problems(*cp, "--model.window", "16", world_size=2)
    )
    pp = [
        "--parallel.pp",
        "2",
        "--parallel.dp_shard",
        "1",
        "--training.global_batch",
        "8",
        "--parallel.pp_microbatches",
        "2",
    ]
    got = problems(*pp, "--data.document_mask", "true", world_size=2)
    assert any("data.document_mask is not supported with parallel.pp > 1" in p for p in got), got
    assert problems(*pp, "--model.window", "16", world_size=2) == []


def test_validate_refuses_bad_window_and_cuda_only_kernels_on_cpu():
    assert any("model.window must be >= 0" in p for p in problems("--model.window", "-1"))
    assert any("window_every >= 1" in p for p in problems("--model.window_every", "0"))
    if not torch.cuda.is_available():
        for backend in ("flex", "efficient", "cudnn"):
            assert any("needs a CUDA device" in p for p in problems("--model.attention", backend))
    assert problems("--model.attention", "math", "--data.document_mask", "true", "--model.window", "8") == []
