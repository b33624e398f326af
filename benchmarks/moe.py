"""Mixture of experts: what its speed costs, what balancing buys, and what expert parallel's all-to-all takes.

Three modes, each measured in one run:

- `throughput` (default): tokens/s of a training step (forward, backward, AdamW) of the debug MoE beside the dense
  model with the same active parameters (ffn_hidden = top_k x moe_hidden, + the shared experts), rounds
  interleaved so the machine's drift hits both alike; median and min-max of the repeats.
- `--balance`: the debug MoE trained by the real loop for 200 steps from the same seed and data without balancing,
  with the aux loss at 0.01, and with the bias method at 0.001 (DeepSeek-V3's rate) and 0.01; the max/mean expert
  load (worst block) at the start and the end.
- `--a2a`: two gloo processes train the debug MoE at parallel.ep = 2 (the real build and step); every all-to-all
  of the dispatch (the counts, the rows out, the rows back, and both again in backward) is timed, and its share of
  the step time reported.

    python benchmarks/moe.py [--repeats 7] [--batch 8] [--seq-len 256] [--threads 2]
    python benchmarks/moe.py --balance [--steps 200]
    python benchmarks/moe.py --a2a [--steps 20]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from scaletrain.config import ModelConfig, MoEConfig
from scaletrain.hardware import cpu_features, cuda_available, sync, usable_cpus
from scaletrain.models import count_parameters, cross_entropy, resolve_model_args
from scaletrain.models.llama import ModelArgs, Transformer
from scaletrain.models.moe import grouped_mm_usable

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "debug_moe.toml"
QUIET = ["--metrics.progress", "false", "--metrics.tensorboard", "false", "--training.eval_interval", "0"]


def dense_twin(args: ModelArgs) -> ModelArgs:
    """The dense model whose SwiGLU has the MoE's active width: top_k routed experts plus the shared ones."""
    hidden = args.moe_hidden or args.ffn_hidden
    return dataclasses.replace(args, n_experts=0, ffn_hidden=hidden * (args.top_k + args.shared_experts))


def _step_fn(args: ModelArgs, batch: int, device: torch.device, precision: str):
    torch.manual_seed(0)
    model = Transformer(args).to(device)
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (batch, args.max_seq_len + 1), generator=g).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def step() -> None:
        with autocast:
            loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)

    return model, step


def throughput(a: argparse.Namespace) -> None:
    device = torch.device(a.device)
    moe_args = resolve_model_args(ModelConfig(preset="debug_moe"), 257, a.seq_len, moe=MoEConfig())
    if moe_args.moe_every != 1 or moe_args.first_dense:
        print("note: the preset has dense blocks too; the twin widens those as well")
    cases = {"debug_moe": moe_args, "dense, same active": dense_twin(moe_args)}
    steps, times = {}, {}
    for name, args in cases.items():
        model, steps[name] = _step_fn(args, a.batch, device, a.precision)
        n = count_parameters(model)
        print(f"{name:<20} {n['total']:>10,} parameters, {n['active']:>10,} active (non-embedding)")
        times[name] = []
    x = torch.zeros(1, 1, dtype=torch.bfloat16 if a.precision == "bf16" else torch.float32, device=device)
    kernel = "torch._grouped_mm" if grouped_mm_usable(x) else "a segment loop (one matmul per expert)"
    print(
        f"experts computed by {kernel}; batch {a.batch} x seq {a.seq_len}, {a.precision}, {a.threads} thread(s)"
    )
    for fn in steps.values():  # warm-up: allocator, first-call logging
        fn()
    for _ in range(a.repeats):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    tokens = a.batch * a.seq_len
    base = statistics.median(times["dense, same active"])
    print(f"\n{'model':<20}{'tok/s median':>14}{'min':>9}{'max':>9}{'step s':>9}{'vs dense':>10}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"{name:<20}{tokens / med:>14,.0f}{tokens / max(ts):>9,.0f}{tokens / min(ts):>9,.0f}{med:>9.4f}"
            f"{base / med:>9.2f}x"
        )


def _train_records(overrides: list[str], run_dir: Path) -> list[dict]:
    from scaletrain.train import train
    from scaletrain.validate import load_config

    with contextlib.redirect_stdout(io.StringIO()):  # the run's own summary table; its log goes to stderr
        train(load_config(str(CONFIG), [*overrides, "--run.dir", str(run_dir), *QUIET]))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def balance(a: argparse.Namespace) -> None:
    ways = {
        "no balancing": ["--moe.aux_loss_coef", "0", "--moe.bias_update_rate", "0"],
        "aux loss 0.01": ["--moe.aux_loss_coef", "0.01", "--moe.bias_update_rate", "0"],
    }
    for rate in a.bias_rates:  # DeepSeek-V3's 0.001, and a faster one for a run this short
        ways[f"bias {rate:g}"] = ["--moe.aux_loss_coef", "0", "--moe.bias_update_rate", str(rate)]
    common = ["--training.steps", str(a.steps), "--metrics.log_interval", "1"]
    common += ["--training.threads", str(a.threads)]
    w = a.window
    print(
        f"debug_moe ({CONFIG.name}), {a.steps} steps; max/mean tokens per expert of the worst block at step 1,"
    )
    print(
        f"averaged over the first and the last {w} steps, and each block's over the last {w}; E/k = 4 is total"
    )
    print("collapse (every token on the same 2 of 8 experts), 1.0 perfect balance\n")
    print(f"{'method':<16}{'step 1':>8}{'start':>8}{'end':>8}{'final loss':>12}  per block at the end")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, extra) in enumerate(ways.items()):
            rows = _train_records(common + extra, Path(tmp) / f"run{i}")
            worst = [r["moe_load_max_mean"] for r in rows]
            layers = sorted(k for k in rows[-1] if k.startswith("moe_load_max_mean/"))
            per_layer = [statistics.mean(r[k] for r in rows[-w:]) for k in layers]
            print(
                f"{name:<16}{worst[0]:>8.2f}{statistics.mean(worst[:w]):>8.2f}{statistics.mean(worst[-w:]):>8.2f}"
                f"{rows[-1]['loss']:>12.4f}  " + " ".join(f"{v:.2f}" for v in per_layer)
            )


class A2ATimer:
    """Seconds in the expert dispatch's all-to-alls on this rank. The row exchange becomes a synchronous
    autograd function of the same collective, so its forward and its backward (the transposed exchange) are
    each timed to completion; the counts exchange is timed as called."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._plain = None

    def install(self) -> None:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        timer, plain = self, dist.all_to_all_single
        self._plain = plain

        class Rows(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, out_splits, in_splits, group):
                ctx.splits, ctx.group = (out_splits, in_splits), group
                return timer.exchange(x, out_splits, in_splits, group)

            @staticmethod
            def backward(ctx, grad):
                out_splits, in_splits = ctx.splits
                return timer.exchange(grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None

        def counts(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return plain(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        funcol.all_to_all_single_autograd = lambda x, out_s, in_s, group: Rows.apply(x, out_s, in_s, group)
        dist.all_to_all_single = counts

    def exchange(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        t0 = time.perf_counter()
        self._plain(out, x, out_splits, in_splits, group=group)
        sync(out.device)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


def _a2a_worker(rank: int, port: int, a: argparse.Namespace, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    timer = A2ATimer()
    timer.install()  # before the build, so that every dispatch goes through it
    from scaletrain.job import build
    from scaletrain.validate import load_config

    overrides = ["--parallel.ep", "2", "--parallel.dp_shard", "2", "--parallel.data_parallel", "fsdp"]
    overrides += ["--training.threads", str(a.threads), "--run.dir", f"{out_dir}/run"]
    overrides += ["--training.global_batch", str(a.batch), "--training.micro_batch", str(a.batch // 2)]
    overrides += ["--data.seq_len", str(a.seq_len)]
    job = build(load_config(str(CONFIG), overrides + QUIET, world_size=2, check_run_dir=False))
    steps, shares = [], []
    for step in range(1, a.warmup + a.steps + 1):
        x, y = job.loader.next_batch()
        timer.seconds = 0.0
        t0 = time.perf_counter()
        job.runner.forward_backward(x.to(job.env.device), y.to(job.env.device))
        job.runner.clip()
        job.optimizers.step()
        job.moe.step_done(step)
        dt = time.perf_counter() - t0
        if step > a.warmup:
            steps.append(dt)
            shares.append(timer.seconds / dt)
    calls = timer.calls / (a.warmup + a.steps)  # 5 per MoE block and micro-batch: counts, rows out/back x 2
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(dict(steps=steps, shares=shares, calls=calls)))
    job.guard.close()
    job.preemption.close()
    job.writer.close()


def a2a(a: argparse.Namespace) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_a2a_worker, args=(port, a, tmp), nprocs=2, start_method="spawn")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
    print(f"debug_moe at parallel.ep = 2 (2 gloo processes, {a.threads} thread(s) each), global batch {a.batch} x "
          f"seq {a.seq_len}, {a.steps} steps after {a.warmup} of warm-up")  # fmt: skip
    print(
        f"{'rank':<6}{'step s median':>14}{'a2a share median':>18}{'min':>8}{'max':>8}{'a2a calls/step':>16}"
    )
    for r, d in enumerate(ranks):
        sh = d["shares"]
        print(
            f"{r:<6}{statistics.median(d['steps']):>14.4f}{statistics.median(sh):>17.1%}{min(sh):>8.1%}"
            f"{max(sh):>8.1%}{d['calls']:>16.0f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--balance", action="store_true", help="the 200-step balancing comparison")
    mode.add_argument("--a2a", action="store_true", help="the all-to-all share of the step at ep = 2")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (per process under --a2a)")
    ap.add_argument("--device", default="cuda" if cuda_available() else "cpu")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--steps", type=int, default=None, help="--balance: 200; --a2a: 20")
    ap.add_argument("--warmup", type=int, default=3, help="--a2a: steps not measured")
    ap.add_argument(
        "--window", type=int, default=10, help="--balance: steps averaged at the start and the end"
    )
    ap.add_argument("--bias-rates", type=float, nargs="+", default=[0.001, 0.01], help="--balance: bias runs")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(cpu_features())
    print(f"torch {torch.__version__}, {usable_cpus()} usable CPUs, load average {os.getloadavg()[0]:.2f}")
    if a.balance:
        a.steps = a.steps or 200
        balance(a)
    elif a.a2a:
        a.steps = a.steps or 20
        a2a(a)
    else:
        throughput(a)


if __name__ == "__main__":
    main()
