"""The first plan on an uncalibrated CPU measures what its estimate needs, in seconds (issue 35): matmul rates per
dtype (and at every core), a block's fixed cost and element-wise bandwidth, AdamW's pass, autocast's casts, gloo
collectives over 2 ranks by message size, one tiny fsdp step that fits the fixed cost of a collective call in
training, and the same step under tp, sp and cp for their fixed costs per block. The same 2 ranks then time a held-out layout (another shape and batch, never fitted), and its
predicted/measured is the error every plan on the probe states. Cached per CPU model, core count and torch
version; `plan --calibrate` (calibrate.py, minutes) replaces it."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from scaletrain.hardware import best_time, busy_reason, cpu_model_name, pin_mmap_threshold, usable_cpus
from scaletrain.parallel.layout import Layout
from scaletrain.planning.calibrate import (
    HALF,
    _fit,
    _tiny_run,
    describe_framework,
    describe_splits,
    fit_collectives,
    fit_split,
    framework_bytes,
    measure_collectives,
    measure_one_thread,
    time_collectives,
    tiny_env,
)
from scaletrain.planning.estimators.hardware import PROBE_FILE, DeviceProfile, probe_key
from scaletrain.planning.estimators.inputs import model_args, parse_unvalidated
from scaletrain.planning.estimators.search import estimate
from scaletrain.planning.measure import run_ranks

# The step the probe fits the collective call's cost on (fsdp, the debug config's family at dim 64) and the held-out
# step it validates with (fsdp over 2 ranks again, but the debug model's shape, 4x the tokens per rank).
FIT = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "2", "--model.n_kv_heads", "1"]
FIT += ["--model.ffn_hidden", "128", "--data.seq_len", "64", "--training.global_batch", "4"]
FIT += ["--training.micro_batch", "2", "--parallel.data_parallel", "fsdp", "--training.threads", "1"]
HELD_OUT = ["--model.dim", "128", "--model.n_layers", "4", "--model.n_heads", "4", "--model.n_kv_heads", "2"]
HELD_OUT += ["--model.ffn_hidden", "352", "--data.seq_len", "128", "--training.global_batch", "8"]
HELD_OUT += ["--training.micro_batch", "4", "--parallel.data_parallel", "fsdp", "--training.threads", "1"]
RANKS = 2
MORE_RANKS = 4  # the collectives alone are timed over this many ranks too
# Each fitted on FIT and on HELD_OUT's model split over the 2 ranks another way, in this order (a later fit counts
# the earlier ones): tensor parallel's, then sequence parallel's and ring attention's cost per block, fixed (DTensor
# dispatch, the ring's loop) and per hidden-state element (the redistributions' copies; calibrate.fit_split).
SPLITS = {
    "tp": ["--parallel.tp", "2", "--model.n_kv_heads", "2"],
    "sp": ["--parallel.tp", "2", "--model.n_kv_heads", "2", "--parallel.sequence_parallel", "true"],
    "cp": ["--parallel.cp", "2"],
}


def run_probe(cache_dir: Path, why: str, log=None) -> DeviceProfile:
    """Measure this CPU (measure) and cache the result in `cache_dir` for this CPU model and torch; `log` (stderr by
    default) says that it did, why (`why`: cached_probe's reason) and where."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    log(
        f"measuring this CPU for the planner ({why}; up to a minute, once per CPU model and torch version) ..."
    )
    start = time.perf_counter()
    path = cache_dir / PROBE_FILE
    busy = busy_reason()  # before the probe's own processes add to the load
    profile = measure(log, cache_dir)
    took = time.perf_counter() - start
    source = f"probed {time.strftime('%Y-%m-%d %H:%M')} in {took:.0f} s, cached in {path}"
    profile = dataclasses.replace(profile, source=source, busy=busy or "")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": probe_key(), "seconds": took, "profile": profile.to_json()}, indent=1))
    os.replace(tmp, path)
    log(f"measured in {took:.0f} s; cached in {path}")
    return profile


def measure(log, cache_dir: Path) -> DeviceProfile:
    """Every measurement of the probe, into one profile whose `validated` states the held-out error."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        profile = measure_one_thread(lambda _: None)  # said in one line below
        # The time model scales the one-thread rate by the threads a rank gets: logged beside what every core does.
        one, every_core = _rate_512(1), _rate_512(usable_cpus())
    finally:
        torch.set_num_threads(threads)
    ranks = run_ranks(_rank, RANKS)
    collectives = {f"{k}@{RANKS}": v for k, v in fit_collectives(ranks["times"], RANKS).items()}
    # And over MORE_RANKS: gloo's figures change with the ranks sharing the cores (on 2 cores a ring step over 4 waits
    # for its peer to be scheduled), which the 2-rank figures do not show: 4-rank fsdp rows were 8-14% faster
    # predicted on those alone (issue 35).
    more = measure_collectives(MORE_RANKS)[0]
    collectives.update({f"{k}@{MORE_RANKS}": v for k, v in more.items()})
    peak, op_overhead = profile.peak_flops, profile.op_overhead_s
    log(
        f"probe: matmul fp32 {peak['fp32'] / 1e9:.1f} GFLOP/s per thread (512^3: {one / 1e9:.1f} on 1 thread, "
        f"{every_core / 1e9:.1f} on {usable_cpus()}); bf16 {peak['bf16'] / 1e9:.1f}; block {op_overhead * 1e3:.2f} ms fixed, element-wise {profile.memory_bw / 1e9:.2f} GB/s, AdamW "
        f"{profile.optimizer_bw / 1e9:.2f} GB/s; "
        + ", ".join(
            f"{k} {lat * 1e6:.0f} us/step {bw / 1e9:.2f} GB/s" for k, (lat, bw) in collectives.items()
        )
    )
    profile = dataclasses.replace(
        profile,
        name=f"{cpu_model_name()} (torch {torch.__version__})",
        collectives=collectives,
        intra_bw=collectives[f"all_reduce@{RANKS}"][1],
        intra_latency=collectives[f"all_reduce@{RANKS}"][0],
        source="probed",
    )
    fit_cfg = parse_unvalidated(None, FIT)
    call = _fit(fit_cfg, RANKS, profile, {"step_time_s": ranks["fit_s"]}, call_by_ranks={str(RANKS): 1.0})
    profile = dataclasses.replace(profile, collective_call_s=call, call_by_ranks={str(RANKS): call})
    for name, split in SPLITS.items():
        runs = [(parse_unvalidated(None, [*base, *split]), {"step_time_s": ranks[f"{name}@{i}"]})
                for i, base in enumerate((FIT, HELD_OUT))]  # fmt: skip
        profile = fit_split(profile, name, RANKS, runs)
    # The framework's resident bytes, which the memory check counts per process: three tiny runs through the CLI
    # (one process, two forked workers, one process in bf16), as a calibration measures them (allocator slack 0: the
    # workers' pinned allocator frees every large tensor; calibration fitted 0.01 on the same host).
    env = tiny_env(cache_dir)
    one, two, half = _tiny_run(1, env, repeats=1), _tiny_run(2, env, repeats=1), _tiny_run(1, env, HALF, 1)
    framework = framework_bytes(profile, one, two, half, 0.0)
    profile = dataclasses.replace(profile, **framework)
    held = parse_unvalidated(None, HELD_OUT)
    predicted = estimate(held, model_args(held), Layout.of(held, RANKS), profile).time["step_time_s"]
    error = predicted / ranks["held_out_s"] - 1
    validated = (
        f"{100 * error:+.0f}% on a held-out layout the probe ran (fsdp over {RANKS} ranks, dim 128, 4 layers: "
        f"predicted {predicted * 1e3:.0f} ms, measured {ranks['held_out_s'] * 1e3:.0f} ms per step, load average "
        f"{os.getloadavg()[0]:.1f})"
    )
    per_block = describe_splits(profile)
    log(
        f"probe: collective call {call * 1e3:.2f} ms; per block {per_block}; {describe_framework(framework)}; "
        f"step time {validated}"
    )
    return dataclasses.replace(profile, validated=validated, expected_error=abs(error))


def _rate_512(threads: int) -> float:
    """FLOP/s of a 512^3 fp32 matmul on `threads` threads."""
    torch.set_num_threads(threads)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    return 2 * 512**3 / best_time(lambda: torch.mm(a, b))


def _rank(rank: int, world: int, port: int, out: str) -> None:
    """One probe rank: gloo collectives by message size (as calibrate times them), then the fitted and the held-out
    layouts' training steps as train.py builds them; rank 0 writes the fastest time of each."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    pin_mmap_threshold()  # the allocator a CPU worker runs with (parallel/mesh.setup_process)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = {
        "times": time_collectives(world),
        "fit_s": _step_s(FIT, world),
        "held_out_s": _step_s(HELD_OUT, world),
        **{
            f"{name}@{i}": _step_s([*base, *split], world)
            for name, split in SPLITS.items()
            for i, base in enumerate((FIT, HELD_OUT))
        },  # fmt: skip
    }
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _step_s(overrides: list[str], world: int) -> float:
    """The fastest of a few training steps (forward and backward, clipping, AdamW) of `overrides`' layout, built as
    every run builds it (job.build_core), each started together on every rank."""
    from scaletrain.job import build_core  # in the spawned rank only: a worker imports the trainer
    from scaletrain.models import build_model
    from scaletrain.parallel.mesh import ParallelDims

    cfg = parse_unvalidated(None, overrides)
    args = model_args(cfg)
    dims = ParallelDims.from_config(cfg.parallel, world)
    dims.build_mesh("cpu")
    _, optimizers, runner = build_core(
        build_model(args, 0, "cpu"), dims, cfg.parallel, cfg.training, cfg.optimizer,
        device=torch.device("cpu"), n_microbatches=1, memory=cfg.memory,
    )  # fmt: skip
    local = cfg.training.global_batch // dims.dp_size
    x = torch.randint(0, args.vocab_size, (local, cfg.data.seq_len))

    def step() -> None:
        runner.forward_backward(x, x)
        runner.clip()
        optimizers.step()

    return best_time(step, 0.0, least=4, before=dist.barrier)
