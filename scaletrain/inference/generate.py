"""Sampling from a model with a KV cache: the prompt runs once through the model's causal path, then each new token
attends to the cached keys and values. Temperature 0 is greedy; otherwise softmax(logits / T) over the top k.
The samples `scaletrain train` ends with (metrics.sample_prompt) are taken here and kept in the run directory."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from scaletrain.config import MetricsConfig
from scaletrain.errors import UserError
from scaletrain.inference.loader import LoadedModel, load_model
from scaletrain.metrics.writer import append_line
from scaletrain.models import Transformer
from scaletrain.models.kv_cache import KVCache
from scaletrain.run.directory import RunDir

SAMPLE_TOKENS = 64
"""New tokens of each sample `scaletrain train` ends with, and `scaletrain generate`'s --max-new-tokens default."""


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
    temperature: float = MetricsConfig.sample_temperature,
    top_k: int = MetricsConfig.sample_top_k,
    seed: int = 0,
) -> tuple[list[int], Generation, str]:
    """The prompt's ids, the generation and its text, with the loaded model's tokenizer. The sampling defaults
    are `scaletrain generate`'s and the train samples' (metrics.sample_*; issue 39: greedy decoding of a small
    model repeats one token to the end)."""
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


@dataclass
class Sample:
    """One continuation of metrics.sample_prompt: a line of `scaletrain train`'s output and of samples.jsonl."""

    checkpoint: str
    """The checkpoint that wrote it (its directory's name, step-N)."""
    prompt: str
    text: str
    """The continuation (the prompt not included)."""
    seed: int
    temperature: float
    top_k: int
    stop: str
    """Generation.stop: 'eod', 'max_new_tokens' or 'context'."""

    def line(self) -> str:
        how = (
            f"seed {self.seed}, temperature {self.temperature:g}, top-k {self.top_k}"
            if self.temperature
            else "greedy"
        )
        return f"sample ({how}): {self.prompt!r} → {self.text!r}"


def take_samples(loaded: LoadedModel, m: MetricsConfig) -> list[Sample]:
    """m.sample_count continuations of m.sample_prompt with seeds 0, 1, ...; at temperature 0, one (greedy: the
    seed changes nothing). `scaletrain generate RUN --prompt PROMPT --seed S` repeats one: its defaults are these."""
    out = []
    for seed in range(m.sample_count if m.sample_temperature > 0 else 1):
        _, result, text = generate_text(
            loaded, m.sample_prompt, SAMPLE_TOKENS, m.sample_temperature, m.sample_top_k, seed
        )
        checkpoint = Path(loaded.source).name
        out.append(
            Sample(checkpoint, m.sample_prompt, text, seed, m.sample_temperature, m.sample_top_k, result.stop)
        )
    return out


def record_samples(run: RunDir, m: MetricsConfig) -> list[str]:
    """The lines `scaletrain train` ends with when metrics.sample_prompt is set: the samples of the run's newest
    checkpoint (on the CPU, as `scaletrain generate` by default), appended to <run.dir>/samples.jsonl for the report.
    A run that left no checkpoint gets the reason instead (the run itself went well; the sample is not worth a
    failing exit)."""
    try:
        samples = take_samples(load_model(run.path), m)
    except UserError as e:
        return [f"sample: not taken ({e})"]
    write_samples(run, samples)
    return [sample.line() for sample in samples]


def write_samples(run: RunDir, samples: list[Sample]) -> None:
    """Append the samples to <run.dir>/samples.jsonl, one JSON object each (the report reads them back)."""
    for sample in samples:
        append_line(run.samples, json.dumps(dataclasses.asdict(sample)) + "\n")
