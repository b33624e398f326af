"""The KV cache: decoding token by token with it gives the logits and tokens of recomputing the whole sequence each
step (also with sliding-window layers and with several tokens appended at once), and sampling is seeded."""

import pytest
import torch

from scaletrain.errors import UserError
from scaletrain.inference.generate import generate, next_token
from scaletrain.models import Transformer
from scaletrain.models.kv_cache import KVCache
from tests import fixtures


def tiny(**kw) -> Transformer:
    """The shared tiny model with 24 positions, in eval mode."""
    return fixtures.tiny(max_seq_len=24, **kw).eval()


@torch.no_grad()
def greedy_recomputed(model: Transformer, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding without a cache: the whole sequence through the model at every step."""
    seq = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([seq]))[0, -1]
        seq.append(int(logits.argmax()))
    return seq[len(prompt) :], logits


@torch.no_grad()
def greedy_cached(model: Transformer, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    cache = KVCache(model.args.n_layers, len(prompt) + n)
    logits = model(torch.tensor([prompt]), cache=cache)[0, -1]
    out = []
    for i in range(n):
        out.append(int(logits.argmax()))
        if i < n - 1:
            logits = model(torch.tensor([[out[-1]]]), cache=cache)[0, -1]
    return out, logits


@pytest.mark.parametrize("window", [0, 5])
def test_cached_greedy_decoding_equals_recomputing_the_sequence(window):
    # window 5 on every other layer: the cached decode step must apply each layer's own window.
    model = tiny(window=window, window_every=2)
    prompt = [3, 17, 42, 5, 9, 11]
    want, want_logits = greedy_recomputed(model, prompt, 14)
    got, got_logits = greedy_cached(model, prompt, 14)
    assert got == want
    # The last step predicted from all 19 positions.
    assert (got_logits - want_logits).abs().max() <= 1e-5


def test_prefill_with_a_cache_is_bitwise_the_uncached_forward():
    model = tiny()
    x = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(x, cache=KVCache(2, 16)), model(x))


def test_several_tokens_appended_to_a_filled_cache_see_the_cache_causally():
    model = tiny(window=4, window_every=2)
    x = torch.randint(0, 64, (1, 15))
    cache = KVCache(2, 15)
    with torch.no_grad():
        full = model(x)
        parts = [model(x[:, :6], cache=cache), model(x[:, 6:11], cache=cache), model(x[:, 11:], cache=cache)]
    assert cache.pos == 15
    assert (torch.cat(parts, dim=1) - full).abs().max() <= 1e-5


def test_a_full_cache_refuses_more_tokens():
    model = tiny()
    cache = KVCache(2, 4)
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="exceed"):
            model(torch.zeros(1, 1, dtype=torch.long), cache=cache)


def test_generate_is_greedy_at_temperature_zero_and_seeded_above():
    model = tiny()
    prompt = [1, 2, 3]
    want, _ = greedy_recomputed(model, prompt, 10)
    assert generate(model, prompt, 10).tokens == want
    assert generate(model, prompt, 10, temperature=1.0, top_k=1, seed=5).tokens == want  # top-1 is greedy
    a = generate(model, prompt, 10, temperature=1.5, seed=7).tokens
    assert a == generate(model, prompt, 10, temperature=1.5, seed=7).tokens
    assert a != generate(model, prompt, 10, temperature=1.5, seed=8).tokens
    # Restricted to the tokenizer's ids, padding ids of the table are never drawn.
    assert max(generate(model, prompt, 20, temperature=5.0, seed=1, vocab=10).tokens) < 10


def test_generate_stops_at_the_end_of_document_and_at_the_context():
    model = tiny()
    first = generate(model, [1, 2, 3], 5).tokens[0]
    stopped = generate(model, [1, 2, 3], 5, stop_id=first)
    assert stopped.tokens == [] and stopped.stop == "eod"
    long = generate(model, list(range(20)), 50)
    assert len(long.tokens) == 4 and long.stop == "context"  # 20 + 4 = the context of 24


@pytest.mark.parametrize(
    "prompt,kwargs,match",
    [
        (list(range(24)), {}, "context is 24"),
        ([], {}, "empty"),
        ([1], {"temperature": -1.0}, "--temperature"),
        ([1], {"top_k": -2}, "--top-k"),
    ],
)
def test_generate_refuses_bad_input(prompt, kwargs, match):
    with pytest.raises(UserError, match=match):
        generate(tiny(), prompt, 5, **kwargs)


def test_top_k_keeps_only_the_k_largest():
    logits = torch.tensor([0.0, 5.0, 4.0, -1.0])
    gen = torch.Generator().manual_seed(0)
    assert {next_token(logits, 10.0, 2, gen) for _ in range(200)} == {1, 2}
