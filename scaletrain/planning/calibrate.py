"""`scaletrain plan --calibrate` (run_calibrate): measure this CPU for the planner — matmul rates at a few shapes (fp32, bf16), the
time of a real block's forward and backward, AdamW's pass over memory, gloo collectives over N local ranks, and a
process's memory before the model — and save the profile (planning/estimators/hardware.py) that later plans use."""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from scaletrain.data import resolve_cache_dir
from scaletrain.hardware import (
    best_time,
    cpu_model_name,
    cuda_available,
    gpu_count,
    pin_mmap_threshold,
    run_from_small_parent,
    usable_cpus,
)
from scaletrain.parallel.layout import Layout
from scaletrain.planning.calibrate_gpu import calibrate_gpu
from scaletrain.planning.estimators.hardware import DEFAULT_CPU, REDO, DeviceProfile, gpu_kind, save_profile
from scaletrain.planning.estimators.inputs import model_args, parse_unvalidated
from scaletrain.planning.estimators.search import estimate
from scaletrain.planning.estimators.time import ADAM_TRAFFIC
from scaletrain.planning.measure import (
    fit_line,
    fit_line_robust,
    measure_adam_bandwidth,
    measure_attention,
    measure_cast,
    measure_matmul,
    run_ranks,
)

COLLECTIVE_BYTES = (2**12, 2**16, 2**20, 2**22)
# Sequence lengths measure_block times its one-block model at: the first so short that the block is all dispatch
# (its element-wise traffic ~1% of the longest's), which measures the fixed cost by itself. A line through all
# lengths put it at 0 in every probe on this host (issue 35): a byte out of cache costs more than one in cache,
# so the line's intercept is below 0, and the search then saw no cost in more, smaller micro-batches.
BLOCK_SEQS = (4, 64, 128, 256, 512)


def measure_block(
    matmul: tuple[float, float], attention: tuple[float, float] | None = None
) -> tuple[float, float, float, float]:
    """(fixed seconds per block forward+backward, element-wise bytes/s, selective recompute's fixed seconds per
    block, the share of the element-wise forward it re-runs): a one-block model (dim 256, a vocabulary of 64 so the
    head is negligible) timed at BLOCK_SEQS' lengths. What its matmuls at the fitted rate do not explain (its
    attention at `attention`'s fp32 figures where measured, as the time model charges it) is a + traffic / bandwidth, with
    the traffic the time model charges (ELEMENTWISE_TRAFFIC x the bytes the block saves): a is that remainder at the
    shortest length, the bandwidth the median of the others' traffic over their remainder beyond a. What the same
    block under selective recompute adds is fitted as a + share x that forward's element-wise time."""
    from scaletrain.config import ParallelConfig
    from scaletrain.models.llama import ModelArgs
    from scaletrain.models.presets import build_model
    from scaletrain.parallel.recompute import apply_recompute
    from scaletrain.planning.estimators.memory import layer_activation_bytes
    from scaletrain.planning.estimators.time import ELEMENTWISE_TRAFFIC, _matmuls, _Shape

    args = ModelArgs(
        dim=256, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=704, vocab_size=64, max_seq_len=512
    )
    model = build_model(args, 0, "cpu")
    selective = apply_recompute(build_model(args, 0, "cpu"), "selective")
    t0, rate = matmul
    xs, ys, extra = [], [], []
    for seq in BLOCK_SEQS:
        tokens = torch.randint(0, 64, (1, seq))
        took = best_time(partial(_forward_backward, model, tokens), budget_s=0.4)
        extra.append(best_time(partial(_forward_backward, selective, tokens), budget_s=0.4) - took)
        shape = _Shape(seq, seq, args.dim, args.dim, args.n_kv_heads * args.head_dim, args.ffn_hidden)
        rates = [rate] * 7 + [attention[1] if attention else rate] * 2  # _matmuls' order: 7 Linears, QKᵀ, AV
        mm = sum(3 * (t0 + f / r) for f, r in zip(_matmuls(shape), rates))
        mm += attention[0] * args.n_heads if attention else 0.0  # its rows: batch 1 x the heads
        xs.append(ELEMENTWISE_TRAFFIC * layer_activation_bytes(args, ParallelConfig(), 1, seq, 4))
        ys.append(max(took - mm, 1e-9))
    a = ys[0]
    b = statistics.median(max(y - a, 1e-12) / x for x, y in zip(xs[1:], ys[1:]))
    ew_fwd = [(a + x * b) / 3 for x in xs]  # the time model's element-wise forward of the block
    sel_a, sel_share = fit_line_robust(ew_fwd, [max(e, 0.0) for e in extra])
    return a, 1.0 / max(b, 1e-15), sel_a, max(sel_share, 0.0)


def _forward_backward(model: torch.nn.Module, tokens: torch.Tensor) -> None:
    model(tokens).float().sum().backward()


def measure_step_overhead(block_overhead: float) -> float:
    """Seconds a training step costs beyond its blocks: a one-block dim-64 model at 8 tokens through loss,
    backward, clipping and AdamW (all dispatch, no arithmetic to speak of), less one block's fixed cost."""
    from scaletrain.models.llama import ModelArgs
    from scaletrain.models.loss import cross_entropy
    from scaletrain.models.presets import build_model

    args = ModelArgs(
        dim=64, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=128, vocab_size=64, max_seq_len=8
    )
    model = build_model(args, 0, "cpu")
    # fused, as training steps (optim/optimizers.adamw_implementation)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x, y = torch.randint(0, 64, (1, 8)), torch.randint(0, 64, (1, 8))

    def step() -> None:
        cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return max(best_time(step, budget_s=0.3) - block_overhead, 0.0)


def _rank(rank: int, world: int, port: int, out: str) -> None:
    """One gloo rank: init, a tiny training step (so the process holds what a worker holds before the model), then
    each collective at each size; rank 0 writes the times and its peak RSS less the tensors it made."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    pin_mmap_threshold()  # the allocator a CPU worker runs with (parallel/mesh.setup_process)
    import scaletrain.train  # noqa: F401  (a worker imports the trainer before anything else)

    dist.init_process_group("gloo", rank=rank, world_size=world)
    measure_step_overhead(0.0)
    times = time_collectives(world)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "rss": rss}))
    dist.barrier()
    dist.destroy_process_group()


def time_collectives(world: int) -> dict[str, list[tuple[int, float]]]:
    """{op: [(bytes, seconds)]}: each collective at each of COLLECTIVE_BYTES over the default group of `world`."""
    times: dict[str, list[tuple[int, float]]] = {"all_reduce": [], "all_gather": [], "reduce_scatter": []}
    for size in COLLECTIVE_BYTES:
        n = size // 4
        full, part = torch.ones(n), torch.ones(max(n // world, 1))
        whole = full[: part.numel() * world]
        # torch 2.13 renames these (the old names warn); either works.
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        ops = {
            "all_reduce": partial(dist.all_reduce, full),
            "all_gather": partial(gather, whole, part),
            "reduce_scatter": partial(scatter, part, whole),
        }
        for name, op in ops.items():
            # The same number of calls on every rank (no time budget), each after a barrier: the first sets up the
            # pairs' buffers, the fastest of the rest counts.
            times[name].append((size, best_time(op, 0.0, least=5, before=dist.barrier)))
    return times


def fit_collectives(times: dict[str, list[tuple[int, float]]], nproc: int) -> dict[str, tuple[float, float]]:
    """{op: (latency per ring step, bandwidth in the ring formula's convention)} fitted to time_collectives' times
    over nproc ranks (none for one rank)."""
    fitted = {}
    for name, points in times.items():
        if nproc < 2:
            break
        factor = (2 if name == "all_reduce" else 1) * (nproc - 1) / nproc
        steps = (2 if name == "all_reduce" else 1) * (nproc - 1)
        a, b = fit_line([factor * s for s, _ in points], [t for _, t in points])
        fitted[name] = (a / steps, 1.0 / max(b, 1e-15))
    return fitted


def measure_collectives(nproc: int) -> tuple[dict[str, tuple[float, float]], int]:
    """({op: (latency per ring step, bandwidth in the ring formula's convention)}, peak RSS of a rank) over nproc
    local gloo ranks; one rank (nproc 1) measures the RSS only."""
    data = run_ranks(_rank, nproc)
    return fit_collectives(data["times"], nproc), int(data["rss"])


TINY = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "2", "--model.n_kv_heads", "1"]
TINY += ["--model.ffn_hidden", "128", "--data.seq_len", "64", "--training.global_batch", "4"]
TINY += ["--training.micro_batch", "2", "--training.steps", "12", "--metrics.log_interval", "2"]
TINY += ["--training.eval_interval", "0", "--training.threads", "1", "--checkpoint.enabled", "false"]
TINY += ["--metrics.progress", "false", "--metrics.tensorboard", "false", "--parallel.data_parallel", "fsdp"]


# Runs of each tiny layout: on a shared machine one run's step time moves by up to ±25% from the next, so each
# constant is fitted to the median of a few (benchmarks/planner_validate.py compares medians too).
TINY_REPEATS = 3


def _tiny_run(n: int, env: dict, extra: tuple[str, ...] = (), repeats: int = TINY_REPEATS) -> dict:
    """The tiny model trained for a few steps on n local processes, `repeats` times: the median of the runs' peak
    RSS, and of their fastest window's step time after the first (each run's window least disturbed by other
    processes, as every calibration figure here)."""
    import statistics
    import tempfile

    runs = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as d:
            cmd = [sys.executable, "-m", "scaletrain", "train", "--nproc", str(n), *TINY, *extra]
            cmd += ["--run.dir", f"{d}/run"]
            run_from_small_parent(cmd, env, check=True, capture_output=True)
            text = Path(f"{d}/run/metrics.jsonl").read_text()
        records = [json.loads(x) for x in text.splitlines() if x.strip()]
        runs.append({**records[-1], "step_time_s": min(r["step_time_s"] for r in records[1:])})
    return {
        **runs[-1],
        "step_time_s": statistics.median(r["step_time_s"] for r in runs),
        "mem_peak_mib": statistics.median(r["mem_peak_mib"] for r in runs),
    }


def tiny_env(cache_dir: Path) -> dict:
    """The environment of the tiny runs, their data tokenised first (and indexed for the launcher): a run that
    prepares the data in its own process counts that in its peak RSS."""
    env = {**os.environ, "SCALETRAIN_CACHE": str(cache_dir)}
    subprocess.run(
        [sys.executable, "-m", "scaletrain", "prepare-data", *TINY], env=env, check=True, capture_output=True
    )
    return env


def _bare(profile: DeviceProfile) -> DeviceProfile:
    return dataclasses.replace(profile, overhead_bytes=0, worker_overhead_bytes=0, step_overhead_s=0.0)


HALF = ("--precision.compute", "bf16")


def framework_bytes(profile: DeviceProfile, one: dict, two: dict, half: dict, slack: float) -> dict[str, int]:
    """The profile's framework bytes before the model's first byte, from the tiny runs' peak RSS less the tensors
    predicted for them and `slack` x their activations: one training process (`one`), a worker the launcher forked
    (`two`, on two processes), and what computing in bf16 adds to one process (`half`). They depend on the CPU and
    the torch build (the pages of the kernels it dispatches to): 365 and 289 MiB on an AMD EPYC, 449, 372 and +30
    on an Intel Xeon with AMX (torch 2.13.0+cpu, issue 35)."""
    bare = _bare(profile)
    out = []
    for n, run, extra in ((1, one, ()), (2, two, ()), (1, half, HALF)):
        cfg = parse_unvalidated(None, [*TINY, *extra])
        plan = estimate(cfg, model_args(cfg), Layout.of(cfg, n), bare).memory
        out.append(int(run["mem_peak_mib"] * 2**20 - plan["total"] - slack * plan["activations"]))
    return {"overhead_bytes": out[0], "worker_overhead_bytes": out[1], "half_overhead_bytes": out[2] - out[0]}


def describe_framework(framework: dict[str, int]) -> str:
    mib = {k: v / 2**20 for k, v in framework.items()}
    return (
        f"framework: {mib['overhead_bytes']:.0f} MiB per process, {mib['worker_overhead_bytes']:.0f} MiB per "
        f"forked worker, {mib['half_overhead_bytes']:+.0f} MiB computing in bf16"
    )


def measure_framework(profile: DeviceProfile, cache_dir: Path, log, nproc: int = 2) -> DeviceProfile:
    """The constants only a real run shows, from a tiny model trained through the CLI: on one process, at small
    and large activations; with fsdp on 2, 4 and 8 (up to nproc; workers forked by the launcher); with tp 2,
    without and with sequence parallel; with cp 2. Peak RSS less the model's predicted bytes is the framework's
    memory, a constant plus a share of the activations (the allocator's slack); the one-process step time less
    the predicted work is the loop's fixed cost per step; what each fsdp run adds beyond the prediction, per
    collective call, is a call's fixed cost at that many processes (on a CPU it grows with the ranks sharing the
    cores); what the tp, sp and cp runs add, per block, is their dispatch cost (DTensor, the ring's chunk loop)."""
    env = tiny_env(cache_dir)
    one, two, half = _tiny_run(1, env), _tiny_run(2, env), _tiny_run(1, env, HALF)
    cfg = parse_unvalidated(None, TINY)
    args = model_args(cfg)
    bare = _bare(profile)
    solo = estimate(cfg, args, Layout.of(cfg, 1), bare)
    step = max(one["step_time_s"] - solo.time["step_time_s"], 0.0)
    fitted = dataclasses.replace(bare, step_overhead_s=step)
    # Each constant is fitted on the run that shows it, in this order (a later fit counts the earlier ones):
    # FSDP's per-call cost with 2, 4, 8 processes, then tp's, sp's and ring attention's per-block cost (fit_split).
    by_ranks = {}
    for n in (2, 4, 8):
        if n <= nproc:
            batch = ["--training.global_batch", str(max(4, n)), "--training.micro_batch", str(max(1, 4 // n))]
            got = two if n == 2 else _tiny_run(n, env, batch)
            layout = parse_unvalidated(None, [*TINY, *batch])
            by_ranks[str(n)] = _fit(layout, n, fitted, got, call_by_ranks={str(n): 1.0})
    fitted = dataclasses.replace(fitted, call_by_ranks=by_ranks, collective_call_s=by_ranks.get("2", 0.0))
    tp2 = ["--parallel.tp", "2", "--model.n_kv_heads", "2"]  # tp needs whole key/value heads
    sp = [*tp2, "--parallel.sequence_parallel", "true"]
    for split, extra in (("tp", tp2), ("sp", sp), ("cp", ["--parallel.cp", "2"])):
        if nproc >= 2:
            shapes = (extra, [*GROWN, *extra])
            runs = [(parse_unvalidated(None, [*TINY, *e]), _tiny_run(2, env, tuple(e))) for e in shapes]
            fitted = fit_split(fitted, split, 2, runs)
    # Memory: the resident bytes beyond the predicted tensors, at small and at large activations (one process).
    big_extra = ["--data.seq_len", "512", "--training.global_batch", "16", "--training.micro_batch", "8"]
    big_cfg = parse_unvalidated(None, [*TINY, *big_extra])
    big, big_plan = (
        _tiny_run(1, env, big_extra),
        estimate(big_cfg, model_args(big_cfg), Layout.of(big_cfg, 1), bare),
    )
    excess = [one["mem_peak_mib"] * 2**20 - solo.memory["total"]]
    excess.append(big["mem_peak_mib"] * 2**20 - big_plan.memory["total"])
    grown = big_plan.memory["activations"] - solo.memory["activations"]
    slack = max((excess[1] - excess[0]) / max(grown, 1.0), 0.0)
    framework = framework_bytes(profile, one, two, half, slack)
    calls = ", ".join(f"{v * 1e3:.2f} ms over {k}" for k, v in by_ranks.items())
    log(
        f"{describe_framework(framework)}; {slack:.2f} x the activations beyond the tensors; {step * 1e3:.1f} ms fixed per step; "
        f"per collective call {calls}; per block {describe_splits(fitted)}"
    )
    return dataclasses.replace(fitted, **framework, activation_slack=slack)


# The tiny layout's model grown to the debug model's shape (dim 128, 4 layers, seq 128, micro-batch 4): a split's
# per-block cost is fitted at both, fixed plus per hidden-state element (16x the tiny one's per micro-batch).
GROWN = ["--model.dim", "128", "--model.n_layers", "4", "--model.n_heads", "4", "--model.n_kv_heads", "2"]
GROWN += ["--model.ffn_hidden", "352", "--data.seq_len", "128", "--training.global_batch", "8"]
GROWN += ["--training.micro_batch", "4"]


def fit_split(profile: DeviceProfile, split: str, n: int, runs: list[tuple[object, dict]]) -> DeviceProfile:
    """`profile` with the cost per block of `split` ("tp", "sp" or "cp": time.split_block_s) fitted to two runs of
    it, (config, measured) at a small and a grown shape: the fixed cost each run alone implies, then the line
    through them over the hidden-state elements of a micro-batch (fixed >= 0, growth >= 0)."""
    fixed, grown = f"{split}_block_s", f"{split}_element_s"
    base = dataclasses.replace(profile, **{grown: 0.0})
    (c1, e1), (c2, e2) = [(_fit(cfg, n, base, got, **{fixed: 1.0}), _hidden(cfg)) for cfg, got in runs]
    per = max((c2 - c1) / (e2 - e1), 0.0)
    a = c1 - per * e1
    if a < 0:  # the grown run alone, through the origin
        a, per = 0.0, c2 / e2
    return dataclasses.replace(profile, **{fixed: a, grown: per})


def describe_splits(profile: DeviceProfile) -> str:
    """Each split's fitted cost per block, as the probe and calibration log it."""
    return ", ".join(
        f"{k} {getattr(profile, f'{k}_block_s') * 1e3:.2f} ms + {getattr(profile, f'{k}_element_s') * 1e9:.0f} ns a "
        "hidden element"
        for k in ("tp", "sp", "cp")
    )


def _hidden(cfg) -> float:
    return cfg.training.micro_batch * cfg.data.seq_len / cfg.parallel.cp * model_args(cfg).dim


def _fit(cfg, n: int, profile: DeviceProfile, got: dict, **unit) -> float:
    """The value of the one profile constant named in `unit` that makes the predicted step time of `cfg` on n
    ranks equal the measured one. Step time is linear in it: predictions at 0 and at `unit` give its weight."""
    args = model_args(cfg)
    zero = {k: (dict.fromkeys(v, 0.0) if isinstance(v, dict) else 0.0) for k, v in unit.items()}
    layout = Layout.of(cfg, n)
    t0 = estimate(cfg, args, layout, dataclasses.replace(profile, **zero)).time["step_time_s"]
    weight = estimate(cfg, args, layout, dataclasses.replace(profile, **unit)).time["step_time_s"] - t0
    return max(got["step_time_s"] - t0, 0.0) / max(weight, 1e-12)


# A machine is busy when other work keeps more than half its CPUs running (1-minute load average): calibration's
# matmul rates, bandwidths and tiny runs then measure a share of the cores, and a plan would carry that forever.
BUSY_SHARE = 0.5


def _load() -> float:
    return os.getloadavg()[0]


def busy_reason(before: float, after: float, own: int, cpus: int) -> str | None:
    """Why a calibration taken between load averages `before` and `after` measured a busy machine, or None. Before,
    all the load is other work; after, up to `own` of it is the calibration's own processes (its last runs keep
    that many busy, and the 1-minute average still counts them)."""
    others = max(before, after - own)
    if others > BUSY_SHARE * cpus:
        return (
            f"the machine was busy: a load average of {others:.1f} beyond the calibration's own on {cpus} CPU(s) "
            f"(more than {BUSY_SHARE:g} x the CPUs), so the figures are a share of the cores"
        )
    return None


def calibrate(cache_dir: Path, nproc: int, log=print) -> tuple[DeviceProfile, Path]:
    """Measure this machine (five minutes or so: 8 tiny training layouts, 3 runs each) and save its profile in
    `cache_dir`; flagged `busy` (and said so by every plan that uses it) when other work loaded the machine."""
    before = _load()
    profile = _measure(cache_dir, nproc, log)
    busy = busy_reason(before, _load(), min(nproc, usable_cpus()), usable_cpus())
    if busy:
        log(f"{busy}; the profile is saved flagged busy: {REDO}")
    profile = dataclasses.replace(profile, busy=busy or "")
    return profile, save_profile(profile, cache_dir)


def measure_one_thread(log) -> DeviceProfile:
    """What both a CPU's calibration and the probe measure on one thread (the caller sets it), in order, logged as
    they come: DEFAULT_CPU with the matmul rates, a block's fixed cost, selective recompute's, the element-wise
    bandwidth (memory_bw), AdamW's (optimizer_bw), autocast's casts and a step's overhead filled in."""
    # Measured with the allocator a CPU worker runs with (parallel/mesh.setup_process): every tensor of 128 KiB or
    # more is a fresh mapping whose pages fault in when first written. Unpinned, the heap reuses resident pages and
    # a step ran faster than any worker's: the CLI's 2-rank rows measured 5-53% slower than the probe predicted.
    pin_mmap_threshold()
    fp32, bf16 = measure_matmul(torch.float32), measure_matmul(torch.bfloat16)
    log(
        f"matmul fp32: t0 {fp32[0] * 1e6:.1f} us, {fp32[1] / 1e9:.2f} GFLOP/s per thread; bf16 {bf16[1] / 1e9:.2f}"
    )
    attention = {"fp32": measure_attention(torch.float32), "bf16": measure_attention(torch.bfloat16)}
    op_overhead, elementwise_bw, sel_fixed, sel_share = measure_block(fp32, attention["fp32"])
    said = ", ".join(
        f"{k} {v[1] / 1e9:.1f} GFLOP/s + {v[0] * 1e6:.0f} us a row" for k, v in attention.items()
    )
    log(
        f"causal attention {said}; block: {op_overhead * 1e3:.2f} ms fixed, element-wise {elementwise_bw / 1e9:.2f} GB/s; selective "
        f"recompute {sel_fixed * 1e3:.2f} ms fixed + {sel_share:.2f} of the element-wise forward"
    )
    adam_bw = measure_adam_bandwidth(ADAM_TRAFFIC)
    log(f"AdamW (fused): {adam_bw / 1e9:.2f} GB/s")
    cast_t0, cast_bw = measure_cast()
    log(
        f"autocast casts: {cast_t0 * 1e6:.1f} us per cast, {cast_bw / 1e9:.2f} GB/s (0: the memory bandwidth's)"
    )
    profile = dataclasses.replace(
        DEFAULT_CPU,
        peak_flops={"fp32": fp32[1], "bf16": bf16[1]},
        matmul={"fp32": fp32, "bf16": bf16},
        memory_bw=elementwise_bw,
        optimizer_bw=adam_bw,
        op_overhead_s=op_overhead,
        cast_t0_s=cast_t0,
        cast_bw=cast_bw,
        selective_block_s=sel_fixed,
        selective_share=sel_share,
        attention=attention,
        step_overhead_s=measure_step_overhead(op_overhead),
        threads=1,
    )
    return profile


def _measure(cache_dir: Path, nproc: int, log) -> DeviceProfile:
    """Every measurement of `calibrate`, in order, into one profile."""
    torch.set_num_threads(1)
    profile = measure_one_thread(log)
    collectives = {}
    for n in sorted({min(2**i, nproc) for i in range(1, 7) if 2 ** (i - 1) < nproc} or {1}):
        fitted, rss = measure_collectives(n)
        collectives.update({f"{name}@{n}": v for name, v in fitted.items()})
    for name, (lat, bw) in collectives.items():
        log(f"{name} gloo ranks: {lat * 1e6:.0f} us per step, {bw / 1e9:.2f} GB/s")
    log(
        f"process before the model: {rss / 2**20:.0f} MiB peak RSS; step overhead "
        f"{profile.step_overhead_s * 1e3:.2f} ms"
    )
    profile = dataclasses.replace(
        profile,
        name=f"{cpu_model_name()} (calibrated, torch {torch.__version__})",
        overhead_bytes=rss,
        cores=usable_cpus(),
        collectives=collectives,
        intra_bw=collectives.get("all_reduce@2", (0, DEFAULT_CPU.intra_bw))[1],
        intra_latency=collectives.get("all_reduce@2", (DEFAULT_CPU.intra_latency, 0))[0],
        source=f"calibrated {time.strftime('%Y-%m-%d %H:%M')} with {nproc} gloo ranks; {sys.platform}",
    )
    return measure_framework(profile, cache_dir, log, nproc)


def run_calibrate(config: str | None, overrides: list[str], device: str | None, nproc: int) -> int:
    """`scaletrain plan --calibrate`: a GPU host measures its GPUs unless told --device cpu; a CPU host its cores.
    The profile is saved in the config's cache directory."""
    cache = resolve_cache_dir(parse_unvalidated(config, overrides).data)
    if cuda_available() and (device or "").lower() != "cpu":
        profile, path = calibrate_gpu(cache, min(nproc, gpu_count()))
        kind = gpu_kind(profile.name)
    else:
        (profile, path), kind = calibrate(cache, nproc), "cpu"
    print(f"saved the profile of {profile.name} to {path}; `--device {kind}` plans use it")
    return 0
