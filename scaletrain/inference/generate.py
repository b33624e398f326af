"""Sampling from a model with a KV cache: the prompt runs once through the model's causal path, then each new token
attends to the cached keys and values. Temperature 0 is greedy; otherwise softmax(logits / T) over the top k."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from scaletrain.errors import UserError
from scaletrain.inference.loader import LoadedModel, load_model
from scaletrain.models import Transformer
from scaletrain.models.kv_cache import KVCache

SAMPLE_TOKENS = 64
"""New tokens of the sample `scaletrain train` prints at the end (metrics.sample_prompt)."""


@dataclass
class Generation:
    tokens: list[int]
    """The new tokens (the prompt not included; the end-of-document token that stopped it neither)."""
    stop: str
    """Why it ended: 'eod' (the model ended the document), 'max_new_tokens', or 'context' (the model's length)."""


def check_sampling(max_new_tokens: int, temperature: float, top_k: int) -> None:
    problems = []
    if max_new_tokens < 1:
        problems.append(f"--max-new-tokens {max_new_tokens} must be >= 1")
    if not temperature >= 0:
        problems.append(f"--temperature {temperature} must be >= 0 (0: greedy)")
    if top_k < 0:
        problems.append(f"--top-k {top_k} must be >= 0 (0: the whole vocabulary)")
    if problems:
        raise UserError("; ".join(problems))


def next_token(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator | None) -> int:
    """One token from the logits [vocab] of the last position."""
    if temperature == 0:
        return int(logits.argmax())
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=gen))


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    stop_id: int | None = None,
    vocab: int | None = None,
) -> Generation:
    """Continue `prompt` (token ids) by up to `max_new_tokens`, within the model's context (args.max_seq_len),
    until `stop_id`. `vocab` restricts sampling to the tokenizer's ids (the model's table is padded beyond them).
    The same seed gives the same tokens."""
    check_sampling(max_new_tokens, temperature, top_k)
    context = model.args.max_seq_len
    if not prompt:
        raise UserError("the prompt is empty; give --prompt with some text")
    if len(prompt) >= context:
        raise UserError(
            f"the prompt is {len(prompt)} tokens, and the model's context is {context}: nothing fits after it; "
            "give a shorter --prompt"
        )
    n_new = min(max_new_tokens, context - len(prompt))
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = KVCache(model.args.n_layers, len(prompt) + n_new)
    logits = model(torch.tensor([prompt], device=device), cache=cache)[0, -1]
    out: list[int] = []
    while True:
        tok = next_token(logits[:vocab] if vocab else logits, temperature, top_k, gen)
        if tok == stop_id:
            return Generation(out, "eod")
        out.append(tok)
        if len(out) == n_new:
            return Generation(out, "max_new_tokens" if n_new == max_new_tokens else "context")
        logits = model(torch.tensor([[tok]], device=device), cache=cache)[0, -1]


def generate_text(
    loaded: LoadedModel,
    prompt: str,
    max_new_tokens: int = SAMPLE_TOKENS,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
) -> tuple[list[int], Generation, str]:
    """The prompt's ids, the generation and its text, with the loaded model's tokenizer."""
    tok = loaded.tokenizer
    ids = tok.encode(prompt)
    result = generate(
        loaded.model, ids, max_new_tokens, temperature, top_k, seed, stop_id=tok.eod_id, vocab=tok.vocab_size
    )
    return ids, result, tok.decode(result.tokens)


def generation_report(prompt: str, ids: list[int], result: Generation, text: str, as_json: bool) -> str:
    """What `scaletrain generate` prints: the prompt and its continuation, or one JSON object."""
    if not as_json:
        return prompt + text
    record = {
        "prompt": prompt,
        "prompt_tokens": ids,
        "tokens": result.tokens,
        "text": text,
        "stop": result.stop,
    }
    return json.dumps(record)


def sample_line(run_dir: Path, prompt: str) -> str:
    """The line `scaletrain train` ends with when metrics.sample_prompt is set: a greedy continuation of the
    prompt by the run's newest checkpoint. A run that left no checkpoint gets the reason instead (the run itself
    went well; the sample is not worth a failing exit)."""
    try:
        loaded = load_model(run_dir)
        _, _, text = generate_text(loaded, prompt)
    except UserError as e:
        return f"sample: not taken ({e})"
    return f"sample: {prompt!r} → {text!r}"
