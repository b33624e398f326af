"""Cost of document masking and sliding-window attention vs dense causal attention, measured in one run.

Two levels, each forward + backward: the attention kernel alone (`AttentionKernel` on [batch, heads, seq, head_dim],
mask building included), and a whole model step of the debug preset. The variants run interleaved round by round,
so that drift of the machine hits them alike; the median and the spread (min-max) of the repeats are reported, and
each variant's ratio to dense causal in the same run.

    python benchmarks/attention.py [--seq 4096] [--repeats 7] [--doc-len 1024] [--window 512] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from scaletrain.config import ModelConfig
from scaletrain.hardware import cpu_features
from scaletrain.models import resolve_model_args
from scaletrain.models.attention import AttentionKernel, attention_masks, document_ids
from scaletrain.models.llama import Transformer
from scaletrain.models.loss import cross_entropy

EOD = 256  # the byte tokenizer's end-of-document id


def packed_tokens(batch: int, seq: int, mean_doc: int, seed: int = 0) -> torch.Tensor:
    """Token ids with an eod after documents of geometric length (mean `mean_doc`), as the loader packs them."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (batch, seq), generator=g)
    eod = torch.rand(batch, seq, generator=g) < 1.0 / mean_doc
    return tokens.masked_fill(eod, EOD)


def kernel_case(q, k, v, doc, window):
    """One forward + backward of the attention call, building its mask as the model does once per forward."""

    def run():
        masks = attention_masks("auto", {window}, doc, q.shape[2], q.device)
        mask = masks[window] if masks is not None else None
        out = AttentionKernel("auto")(q, k, v) if mask is None else AttentionKernel("auto")(q, k, v, mask)
        out.sum().backward()

    return run


def model_case(model, tokens, doc):
    def run():
        x, y = tokens[:, :-1], tokens[:, 1:]
        logits = model(x, document_ids=doc[:, :-1]) if doc is not None else model(x)
        cross_entropy(logits, y).backward()

    return run


def measure(cases: dict, repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():  # warm-up (allocator, one-time logging)
        fn()
    for _ in range(repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def report(title: str, times: dict[str, list[float]]) -> None:
    base = statistics.median(times["dense causal"])
    print(f"\n{title}")
    print(f"{'variant':<28}{'median s':>10}{'min s':>9}{'max s':>9}{'vs dense':>10}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<28}{med:>10.4f}{min(ts):>9.4f}{max(ts):>9.4f}{med / base:>9.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--doc-len", type=int, default=1024, help="mean document length in tokens")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    print(cpu_features())
    print(f"SDPA CPU capability: {torch.backends.cpu.get_cpu_capability()}; threads {a.threads}")
    tokens = packed_tokens(a.batch, a.seq + 1, a.doc_len)
    doc = document_ids(tokens, EOD)
    print(f"seq {a.seq}, batch {a.batch}: {int(doc[:, -1].max()) + 1} documents in row 0 (mean {a.doc_len})")

    q = torch.randn(a.batch, a.heads, a.seq, a.head_dim, requires_grad=True)
    k = torch.randn(a.batch, a.kv_heads, a.seq, a.head_dim, requires_grad=True)
    v = torch.randn(a.batch, a.kv_heads, a.seq, a.head_dim, requires_grad=True)
    d = doc[:, :-1]
    kernel = {
        "dense causal": kernel_case(q, k, v, None, 0),
        "document mask": kernel_case(q, k, v, d, 0),
        f"window {a.window}": kernel_case(q, k, v, None, a.window),
        "document mask + window": kernel_case(q, k, v, d, a.window),
    }
    shape = f"q {tuple(q.shape)}, kv heads {a.kv_heads}"
    report(f"attention kernel, forward + backward ({shape}), fp32", measure(kernel, a.repeats))

    args = resolve_model_args(ModelConfig(preset="debug"), 257, a.seq)
    models = {w: _model(args, w) for w in (0, a.window)}
    step = {
        "dense causal": model_case(models[0], tokens, None),
        "document mask": model_case(models[0], tokens, doc),
        f"window {a.window}": model_case(models[a.window], tokens, None),
        "document mask + window": model_case(models[a.window], tokens, doc),
    }
    report("debug model (4 layers, dim 128), forward + backward, fp32", measure(step, a.repeats))


def _model(args, window: int) -> Transformer:
    args = type(args)(**{**args.__dict__, "window": window})
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    return model


if __name__ == "__main__":
    main()
