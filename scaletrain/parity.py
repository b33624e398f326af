"""`scaletrain parity`: train the same model on the same data in several parallel layouts and compare each
with the single-process run, step by step (losses and gradient norms).

    scaletrain parity --config configs/debug.toml --layouts "dp_shard=2" "tp=2" "pp=2,pp_schedule=1f1b" --steps 10
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from scaletrain.errors import ConfigError
from scaletrain.parallel.mesh import MESH_DIMS


@dataclass
class ParityResult:
    layout: str
    nproc: int
    max_loss_rel: float
    max_grad_norm_rel: float
    ok: bool


def parse_layout(text: str) -> tuple[int, list[str]]:
    """'pp=2,pp_schedule=1f1b' -> (world size, ['--parallel.pp', '2', ...]); dp_shard defaults to 1 here so the
    world size is the product of the sizes given (nproc=N overrides it)."""
    sizes = dict.fromkeys(MESH_DIMS, 1)
    overrides, nproc = [], None
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise ConfigError(f"layout '{text}': '{item}' is not key=value (e.g. tp=2 or pp_schedule=gpipe)")
        key, value = (s.strip() for s in item.split("=", 1))
        if key in sizes or key == "nproc":
            try:
                number = int(value)
            except ValueError:
                raise ConfigError(f"layout '{text}': {key} must be an integer, got '{value}'") from None
            if key == "nproc":
                nproc = number
                continue
            sizes[key] = number
        overrides += [f"--parallel.{key}", value]
    world = nproc or math.prod(sizes.values())
    return world, overrides


def _run(args: list[str], nproc: int, run_dir: Path) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "scaletrain",
        "train",
        "--nproc",
        str(nproc),
        *args,
        "--run.dir",
        str(run_dir),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise ConfigError(f"run failed ({' '.join(cmd[3:])}):\n{tail}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def run_parity(
    config: str | None,
    layouts: list[str],
    steps: int,
    overrides: list[str],
    rtol: float,
    out: Callable[[str], None] = print,
) -> list[ParityResult]:
    """fp32, deterministic kernels, metrics every step, no evaluation: only the parallel layout differs."""
    base = (
        (["--config", config] if config else [])
        + overrides
        + [
            "--training.steps",
            str(steps),
            "--training.precision",
            "fp32",
            "--training.eval_interval",
            "0",
            "--metrics.log_interval",
            "1",
            "--metrics.progress",
            "false",
            "--metrics.tensorboard",
            "false",
            "--training.threads",
            "1",
        ]
    )
    parsed = [(layout, *parse_layout(layout)) for layout in layouts]  # every layout checked before any run
    # The reference: every mesh dim of size 1 (dp_shard -1 is the one process), plain DDP.
    single = ["--parallel.data_parallel", "ddp"]
    for dim in MESH_DIMS:
        single += [f"--parallel.{dim}", "-1" if dim == "dp_shard" else "1"]
    results = []
    with tempfile.TemporaryDirectory(prefix="scaletrain-parity-") as tmp:
        ref = _run(base + single, 1, Path(tmp) / "reference")
        ref_loss, ref_gn = [m["loss"] for m in ref], [m["grad_norm"] for m in ref]
        out(f"reference (1 process): final loss {ref_loss[-1]:.6f}")
        for i, (layout, nproc, layout_args) in enumerate(parsed):
            try:
                got = _run(base + layout_args, nproc, Path(tmp) / f"layout{i}")
            except ConfigError as e:
                results.append(ParityResult(layout, nproc, math.inf, math.inf, False))
                out(f"{layout:40s} nproc {nproc}  FAILED: {e.problems[0]}")
                continue
            dl = _max_rel([m["loss"] for m in got], ref_loss)
            dg = _max_rel([m["grad_norm"] for m in got], ref_gn)
            results.append(ParityResult(layout, nproc, dl, dg, dl <= rtol and dg <= rtol))
            out(
                f"{layout:40s} nproc {nproc}  max rel diff: loss {dl:.2e}  grad norm {dg:.2e}  "
                f"{'OK' if results[-1].ok else 'MISMATCH'} (rtol {rtol:g})"
            )
    return results
