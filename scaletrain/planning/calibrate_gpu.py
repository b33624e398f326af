"""`scaletrain plan --calibrate` on a GPU host: measure the local GPUs for the planner — matmul rates at
transformer-sized shapes (bf16, fp32), HBM bandwidth through AdamW's pass, and NCCL all-reduce over the local GPUs —
and save a profile of the GPU's kind: its datasheet profile (planning/estimators/hardware.py) with the measured figures in
place of the stated fractions. Links between nodes cannot be measured from one node and keep the datasheet's.

The same code runs on a CPU (gloo, small shapes), which is how CI tests it; only the GPU gives figures to plan by."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from scaletrain.hardware import best_time
from scaletrain.planning.estimators.hardware import GPUS, DeviceProfile, gpu_kind, save_profile
from scaletrain.planning.estimators.time import ADAM_TRAFFIC
from scaletrain.planning.measure import fit_line, measure_adam_bandwidth, measure_matmul, run_ranks

# Square matmul sizes and all-reduce bytes: from launch-bound to rate-bound on a GPU; small enough for CI on a CPU.
SHAPES = {"cuda": (1024, 2048, 4096, 8192), "cpu": (64, 128, 256)}
ALL_REDUCE_BYTES = {"cuda": (2**20, 2**24, 2**27, 2**28), "cpu": (2**12, 2**16, 2**20)}
ADAM_PARAMS = {"cuda": 2**26, "cpu": 2**20}


def _all_reduce_rank(rank: int, world: int, port: int, device_type: str, out: str) -> None:
    """One rank on its own device (NCCL; gloo on a CPU): the fastest all-reduce at each size; rank 0 writes them."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=world)
    points = []
    for size in ALL_REDUCE_BYTES[device_type]:
        x = torch.ones(size // 4, device=device)
        # The same number of calls on every rank (no time budget: ranks that stopped at different counts would pair
        # one size's all-reduce with another's); the first sets up the buffers, the fastest of the rest counts.
        points.append((size, best_time(partial(dist.all_reduce, x), 0.0, 8, device)))
    if rank == 0:
        Path(out).write_text(json.dumps(points))
    dist.barrier()
    dist.destroy_process_group()


def measure_all_reduce(nproc: int, device_type: str) -> tuple[float, float]:
    """(latency per ring step, per-rank bandwidth in the ring formula's convention) of all-reduce over nproc local
    devices, fitted to 2(n-1)·α + 2(n-1)/n·S/B."""
    points = run_ranks(_all_reduce_rank, nproc, device_type)
    a, b = fit_line([2 * (nproc - 1) / nproc * s for s, _ in points], [t for _, t in points])
    return a / (2 * (nproc - 1)), 1.0 / max(b, 1e-18)


def calibrate_gpu(
    cache_dir: Path, nproc: int, log=print, *, device: str = "cuda", name: str | None = None
) -> tuple[DeviceProfile, Path]:
    """Measure the local GPUs (nproc of them for the all-reduce; 1: none) and save the profile of their kind.
    `device` and `name` exist for the CPU test of this logic: "cpu" measures the host under a GPU's name."""
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    name = name or torch.cuda.get_device_name(dev)
    kind = gpu_kind(name)
    sheet = GPUS[kind]
    shapes = SHAPES[dev.type]
    bf16, fp32 = measure_matmul(torch.bfloat16, dev, shapes), measure_matmul(torch.float32, dev, shapes)
    achieved = bf16[1] / sheet.peak_flops["bf16"]
    log(
        f"matmul bf16: t0 {bf16[0] * 1e6:.1f} us, {bf16[1] / 1e12:.1f} TFLOP/s ({100 * achieved:.0f}% of the "
        f"datasheet's {sheet.peak_flops['bf16'] / 1e12:.0f}); fp32 {fp32[1] / 1e12:.1f} TFLOP/s"
    )
    matmul = {"bf16": bf16, "fp16": bf16, "fp32": fp32}
    if (
        "fp8" in sheet.peak_flops
    ):  # not measured (torchao's scaled matmul is not timed here): bf16's achieved share
        matmul["fp8"] = (bf16[0], sheet.peak_flops["fp8"] * achieved)
    hbm = measure_adam_bandwidth(ADAM_TRAFFIC, dev, ADAM_PARAMS[dev.type])
    log(f"AdamW pass: {hbm / 1e12:.2f} TB/s")
    intra = (sheet.intra_latency, sheet.intra_bw)
    if nproc >= 2:
        intra = measure_all_reduce(nproc, dev.type)
        log(
            f"all_reduce over {nproc} local devices: {intra[0] * 1e6:.1f} us per step, {intra[1] / 1e9:.0f} GB/s"
        )
    total = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else sheet.memory_bytes
    profile = dataclasses.replace(
        sheet,
        name=f"{name} (calibrated, torch {torch.__version__})",
        matmul=matmul,
        memory_bw=hbm,
        memory_bytes=total,
        intra_latency=intra[0],
        intra_bw=intra[1],
        source=f"calibrated {time.strftime('%Y-%m-%d %H:%M')} on {nproc} local {dev.type} device(s); inter-node "
        "links from the datasheet",
    )
    return profile, save_profile(profile, cache_dir, kind)
