"""Training-loop overhead: scaletrain's full `train()` against a bare PyTorch loop with the same model math.

Both run the same Llama module, the same batches (scaletrain's loader over the same data), AdamW settings and
gradient clipping on the same device; the bare loop has no schedule, metrics or logging. Rounds alternate
(scaletrain, bare, scaletrain, ...) so that noise from a shared machine hits both sides alike; the ratio of median
step times is the figure to quote.

    python benchmarks/throughput.py [--steps 30] [--rounds 5] [--preset debug] [--seq-len 256] [--batch 16]

One side, once, written as JSON (the GPU check runs each side in a process of its own, so that each has its own
peak memory and a hung compile can be killed alone):

    python benchmarks/throughput.py --side bare --device cuda --precision bf16 --preset 1B --seq-len 2048 \
        --batch 8 --steps 15 --warmup 5 [--compile] --json bare.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_check import config_key  # benchmarks/ is on sys.path: this script's folder

from scaletrain.data import build_loader, load_tokenizer
from scaletrain.hardware import cpu_features, gpu_peak_flops
from scaletrain.metrics.mfu import flops_per_token
from scaletrain.models import build_meta_model, build_model, count_parameters, resolve_model_args
from scaletrain.run.directory import RunDir
from scaletrain.train import train
from scaletrain.validate import load_config


def overrides(args, run_dir: Path) -> list[str]:
    """The run both sides take their config (and so their data and model) from."""
    return [
        "--model.preset", args.preset,
        "--data.seq_len", str(args.seq_len),
        "--training.steps", str(args.steps),
        "--training.global_batch", str(args.batch),
        "--training.micro_batch", str(args.batch),
        "--training.eval_interval", "0",
        "--training.threads", str(args.threads),
        "--training.device", args.device,
        "--" + config_key("training.compile"), str(args.compile).lower(),
        "--" + config_key("precision.compute", "training.precision"), args.precision,
        "--checkpoint.enabled", "false",
        "--metrics.log_interval", str(args.log_interval),
        "--metrics.progress", "false",
        "--metrics.tensorboard", "false",
        "--run.dir", str(run_dir),
    ]  # fmt: skip


def scaletrain_run(args, run_dir: Path) -> dict:
    """scaletrain's train() in this process; its metrics.jsonl windows after the warm-up steps."""
    train(load_config(None, overrides(args, run_dir)))
    rows = [r for r in RunDir.at(run_dir).read_metrics() if r.get("step_time_s") is not None]
    timed = [r for r in rows if r["step"] > args.warmup] or rows[-1:]
    return {
        "step_times_s": [r["step_time_s"] for r in timed],  # per-step means of log_interval windows
        "peak_mem_mib": max(r["mem_peak_mib"] for r in rows),
        "mfu_reported": statistics.mean(r["mfu"] for r in timed),
        "final_loss": rows[-1]["loss"],
    }


def bare_run(args, run_dir: Path) -> dict:
    """nanoGPT-style: forward, loss, backward, clip, step. Nothing else. The model, its initial weights and the
    batches are scaletrain's (same config), the optimizer is AdamW as scaletrain builds it on this device."""
    cfg = load_config(None, overrides(args, run_dir))
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    loader = build_loader(cfg.data, tokenizer, args.batch, 0, 1, cfg.training.seed, lambda _: None)
    margs = resolve_model_args(cfg.model, tokenizer.vocab_size, args.seq_len)
    model = build_model(margs, cfg.training.seed, device)
    if args.compile:
        for block in model.layers.values():
            block.compile()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.95),
        fused=cuda,
        foreach=not cuda,
    )
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    autocast = torch.autocast(device.type, dtype=half or torch.float32, enabled=half is not None)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], None
    for _ in range(args.steps):
        t0 = time.perf_counter()  # the batch counts, as scaletrain's loader does in its step time
        inputs, targets = loader.next_batch()
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with autocast:
            logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.item()  # waits for the device: the step is over
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
    return {"step_times_s": times[args.warmup :], "peak_mem_mib": peak, "final_loss": loss}


def one_side(args) -> dict:
    """One side's run with the figures the GPU check reports: tokens/s over the timed steps, MFU against the
    device's bf16 datasheet peak (or, off the GPU table, the peak scaletrain's own MFU used), peak memory."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, overrides(args, Path(tmp) / "run"))
        margs = resolve_model_args(cfg.model, load_tokenizer(cfg.data.tokenizer).vocab_size, args.seq_len)
        n_params = count_parameters(build_meta_model(margs))
        out = (scaletrain_run if args.side == "scaletrain" else bare_run)(args, Path(tmp) / "run")
    fpt = flops_per_token(n_params["active"], margs.n_layers, margs.dim, args.seq_len)
    step_s = statistics.mean(out["step_times_s"])
    tokens_per_s = args.batch * args.seq_len / step_s
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    peak = gpu_peak_flops(name, "bf16" if args.precision in ("bf16", "fp16", "fp8") else "fp32")
    return {
        **out,
        "side": args.side,
        "device": name,
        "preset": args.preset,
        "precision": args.precision,
        "compile": args.compile,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "timed_steps": args.steps - args.warmup,
        "mean_step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": fpt,
        "peak_flops": peak,
        "mfu": tokens_per_s * fpt / peak if peak else None,
        "wall_s": time.perf_counter() - t0,
    }


def rounds(args) -> None:
    """The CPU benchmark: alternating rounds of both sides, the ratio of median step times."""
    ours, bare, ratios = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            mine = scaletrain_run(args, Path(tmp) / f"run{r}")["step_times_s"]
            theirs = bare_run(args, Path(tmp) / f"bare{r}")["step_times_s"]
            ours += mine
            bare += theirs
            ratios.append(statistics.median(theirs) / statistics.median(mine))
    tokens = args.batch * args.seq_len
    t_ours, t_bare = statistics.median(ours), statistics.median(bare)
    print(
        f"\n{args.preset} preset, {args.precision}, batch {args.batch} x {args.seq_len} tokens, "
        f"{args.threads} threads, {args.rounds} alternating rounds of {args.steps} steps (first {args.warmup} "
        "of each dropped)"
    )
    print(f"  CPU: {cpu_features()}")
    print(f"  bare PyTorch loop : {tokens / t_bare:10.0f} tokens/s  (median step {t_bare * 1e3:.1f} ms)")
    print(f"  scaletrain train(): {tokens / t_ours:10.0f} tokens/s  (median step {t_ours * 1e3:.1f} ms)")
    print(f"  ratio scaletrain / bare = {t_bare / t_ours:.3f}  (target >= 0.97)")
    print(
        f"  per-round ratios: {', '.join(f'{r:.3f}' for r in ratios)}  (min {min(ratios):.3f}, median "
        f"{statistics.median(ratios):.3f}, max {max(ratios):.3f})"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps not timed (a multiple of --log-interval)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--preset", default="debug")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--compile", action="store_true", help="torch.compile each block (training.compile)")
    p.add_argument("--log-interval", type=int, default=5, help="scaletrain's metrics window")
    p.add_argument("--side", choices=["both", "scaletrain", "bare"], default="both")
    p.add_argument("--json", help="with --side scaletrain|bare: write that side's figures here")
    args = p.parse_args()
    if args.side == "both":
        rounds(args)
        return
    result = one_side(args)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
