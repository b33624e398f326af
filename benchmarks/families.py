"""Tokens/s and peak memory of each model family's debug preset beside Llama's (issue 36), one process each, fp32 on
this machine's CPU: forward, backward and an AdamW step on [4, 128] batches, timed over several repeats (median and
spread), after two warm-up steps. The peak is the process's max RSS (each family in its own process). Parameters
are printed total and active (a token's share), so the MoE rows can be read beside the dense ones.

    PYTHONPATH=. python benchmarks/families.py [--steps 5 --repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

PRESETS = ["debug", "debug_qwen3", "debug_moe", "debug_qwen3_moe", "debug_gpt_oss", "debug_deepseek_v3"]
BATCH, SEQ = 4, 128


def measure(preset: str, steps: int, repeats: int) -> dict:
    import torch

    from scaletrain.config import ModelConfig
    from scaletrain.models import build_model, resolve_model_args
    from scaletrain.models.llama import count_parameters

    torch.set_num_threads(1)
    args = resolve_model_args(ModelConfig(preset=preset), 256, SEQ)
    model = build_model(args, seed=0, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, args.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        loss = model(x[:, :-1], targets=x[:, 1:]) / x[:, 1:].numel()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        rates.append(steps * BATCH * SEQ / (time.perf_counter() - t0))
    counts = count_parameters(model)
    return {
        "preset": preset,
        "params": counts["total"],
        "active": counts["active"],
        "tokens_per_s": statistics.median(rates),
        "spread": (min(rates), max(rates)),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--one", default="")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure(a.one, a.steps, a.repeats)))
        return
    print(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; fp32, 1 thread, batch {BATCH}x{SEQ}"
    )
    print(f"{'preset':18} {'params':>9} {'active':>9} {'tokens/s':>9} {'(min-max)':>15} {'peak MiB':>9}")
    for preset in PRESETS:
        cmd = [
            sys.executable,
            __file__,
            "--one",
            preset,
            "--steps",
            str(a.steps),
            "--repeats",
            str(a.repeats),
        ]
        r = json.loads(
            subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1]
        )
        lo, hi = r["spread"]
        print(
            f"{preset:18} {r['params']:>9,} {r['active']:>9,} {r['tokens_per_s']:>9.0f} {f'({lo:.0f}-{hi:.0f})':>15} "
            f"{r['peak_rss_mib']:>9.0f}"
        )


if __name__ == "__main__":
    main()
