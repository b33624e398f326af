"""Peak memory and step time of the loss, the whole logits (before issue 40) against the chunked one, in one run.

The issue's case: the debug model (dim 128, 4 layers, untied), seq 512, 3 AdamW steps, vocabularies 512 and
128,256. `whole` is the step before issue 40 (`cross_entropy(model(x), y)`: the logits, their log-softmax and
gradient, each [tokens x vocab] fp32); `chunked` is today's (`model(x, targets=y)`, models/loss.py). Each
(variant, vocabulary) runs in a fresh process, `--repeats` times in alternation, since peak RSS only ever grows
within a process. Reported per case: the median peak RSS and step time (steps 2-3) with their spread (min-max),
and the vocabulary's activation cost: the peak's growth from vocabulary 512 to the large one, less the tables'
own state (parameter, gradient, two AdamW moments, both tables), as a fraction of one fp32 logits tensor. The step
times are then compared in one process per vocabulary, the two variants alternating step by step (`--rounds`), whose
per-round ratio is robust to a shared machine's changing load, unlike times from separate processes.

    python benchmarks/loss_memory.py [--seqs 8] [--repeats 3] [--variants whole chunked] [--rounds 6] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from scaletrain.models import ModelArgs, build_model, cross_entropy

VOCABS = (512, 128_256)
SEQ = 512


def one_case(variant: str, vocab: int, seqs: int, steps: int) -> dict:
    """Train `steps` steps in this process; its peak RSS and per-step times."""
    args = ModelArgs(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=352, vocab_size=vocab, max_seq_len=SEQ
    )
    model = build_model(args, 0, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    g = torch.Generator().manual_seed(0)
    times, losses = [], []
    for _ in range(steps):
        x = torch.randint(0, vocab, (seqs, SEQ + 1), generator=g)
        inputs, targets = x[:, :-1], x[:, 1:]
        start = time.perf_counter()
        if variant == "whole":
            loss = cross_entropy(model(inputs), targets)
        else:
            loss = model(inputs, targets=targets) / targets.numel()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mib": peak_mib, "step_s": statistics.median(times[1:] or times), "losses": losses}


def step_time(
    variant: str, model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor
) -> tuple[float, float]:
    """Wall-clock and CPU seconds of one step (CPU time, summed over threads, counts the work even when a shared
    machine's load stretches the wall clock)."""
    start, cpu = time.perf_counter(), time.process_time()
    inputs, targets = x[:, :-1], x[:, 1:]
    if variant == "whole":
        loss = cross_entropy(model(inputs), targets)
    else:
        loss = model(inputs, targets=targets) / targets.numel()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start, time.process_time() - cpu


def timing_case(vocab: int, seqs: int, rounds: int) -> dict:
    """Step times of both variants in one process, alternating step by step (the order swapped each round), so a
    shared machine's load changes both alike: the per-round ratio chunked / whole is what is compared."""
    args = ModelArgs(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=352, vocab_size=vocab, max_seq_len=SEQ
    )
    models = {v: build_model(args, 0, "cpu") for v in ("whole", "chunked")}
    opts = {v: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True) for v, m in models.items()}
    g = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"whole": [], "chunked": [], "whole_cpu": [], "chunked_cpu": []}
    for r in range(rounds + 1):  # round 0 warms up
        x = torch.randint(0, vocab, (seqs, SEQ + 1), generator=g)
        for v in ("whole", "chunked") if r % 2 else ("chunked", "whole"):
            wall, cpu = step_time(v, models[v], opts[v], x)
            if r:
                times[v].append(wall)
                times[f"{v}_cpu"].append(cpu)
    return times


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.2f} ({min(values):,.2f}-{max(values):,.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=["whole", "chunked"], choices=["whole", "chunked"])
    ap.add_argument("--rounds", type=int, default=6, help="timing: alternating steps of both variants")
    ap.add_argument("--case", nargs=2, metavar=("VARIANT", "VOCAB"), help=argparse.SUPPRESS)
    ap.add_argument("--time", type=int, metavar="VOCAB", help=argparse.SUPPRESS)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.case:
        print(json.dumps(one_case(a.case[0], int(a.case[1]), a.seqs, a.steps)))
        return
    if a.time:
        print(json.dumps(timing_case(a.time, a.seqs, a.rounds)))
        return
    runs: dict[tuple[str, int], list[dict]] = {}
    for _ in range(a.repeats):
        for vocab in VOCABS:
            for variant in a.variants:
                cmd = [sys.executable, __file__, "--case", variant, str(vocab), "--seqs", str(a.seqs)]
                cmd += ["--steps", str(a.steps), "--threads", str(a.threads)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                runs.setdefault((variant, vocab), []).append(json.loads(out.splitlines()[-1]))
    if runs:
        memory_table(runs, a)
    if len(a.variants) < 2:
        return
    for vocab in VOCABS:
        cmd = [
            sys.executable,
            __file__,
            "--time",
            str(vocab),
            "--seqs",
            str(a.seqs),
            "--rounds",
            str(a.rounds),
        ]
        cmd += ["--threads", str(a.threads)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
        t = json.loads(out.stdout.splitlines()[-1])
        for unit, w_key, c_key in (("wall", "whole", "chunked"), ("CPU", "whole_cpu", "chunked_cpu")):
            ratios = [c / w for w, c in zip(t[w_key], t[c_key], strict=True)]
            print(
                f"vocab {vocab:,}, one process, {a.rounds} alternating rounds, {unit} s per step: whole "
                f"{spread(t[w_key])}, chunked {spread(t[c_key])}; chunked / whole per round {spread(ratios)}"
            )


def memory_table(runs: dict, a: argparse.Namespace) -> None:
    tokens = a.seqs * SEQ
    logits_mib = tokens * VOCABS[-1] * 4 / 2**20
    tables_mib = 2 * (VOCABS[-1] - VOCABS[0]) * 128 * 4 * 4 / 2**20
    print(f"debug model, dim 128, untied, {a.seqs} x {SEQ} tokens, {a.steps} steps, {a.threads} threads, "
          f"{a.repeats} repeats; one fp32 logits tensor at vocab {VOCABS[-1]:,}: {logits_mib:,.0f} MiB; "
          f"tables' state growth: {tables_mib:,.0f} MiB")  # fmt: skip
    print("| variant | vocabulary | peak MiB, median (min-max) | step s, median (min-max) | first loss |")
    print("|---|---:|---:|---:|---:|")
    for (variant, vocab), rs in runs.items():
        peaks, steps = [r["peak_mib"] for r in rs], [r["step_s"] for r in rs]
        print(f"| {variant} | {vocab:,} | {spread(peaks)} | {spread(steps)} | {rs[0]['losses'][0]:.6f} |")
    for variant in a.variants:
        small = statistics.median(r["peak_mib"] for r in runs[(variant, VOCABS[0])])
        large = statistics.median(r["peak_mib"] for r in runs[(variant, VOCABS[-1])])
        cost = large - small - tables_mib
        print(
            f"{variant}: vocabulary's activation cost {cost:,.0f} MiB = {cost / logits_mib:.2f} of one fp32 logits"
        )
    if len(a.variants) == 2:
        for vocab in VOCABS:
            ratios = [
                c["step_s"] / w["step_s"]
                for w, c in zip(runs[("whole", vocab)], runs[("chunked", vocab)], strict=True)
            ]
            print(
                f"vocab {vocab:,}: chunked / whole step time, separate processes, per repeat: {spread(ratios)}"
            )


if __name__ == "__main__":
    main()
