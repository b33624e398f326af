"""`scaletrain parity`: train the same model on the same data in several parallel layouts and compare each
with the single-process run: losses and gradient norms step by step, and every parameter at the end.

    scaletrain parity --config configs/debug.toml --layouts "dp_shard=2" "tp=2" "pp=2,pp_schedule=1f1b" --steps 10
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from scaletrain.checkpoint.run_model import load_run_model
from scaletrain.errors import ConfigError, UserError
from scaletrain.parallel.mesh import MESH_DIMS
from scaletrain.run.child import run_train
from scaletrain.validate import check_configs

# Every run ends with one synchronous save into its own run directory, whatever the user's overrides say (they
# come first, so these win): the final parameters are read back from it.
FINAL_SAVE = [
    "--checkpoint.enabled",
    "true",
    "--checkpoint.interval",
    "0",
    "--checkpoint.async_save",
    "false",
    "--checkpoint.storage=",
]
RTOL, ATOL = 1e-5, 2e-5  # the accepted differences (run_parity's docstring says why atol); the CLI's defaults


def run_settings(steps: int) -> list[str]:
    """What every run of a comparison is given after the user's overrides: the final save, `steps` steps, fp32, a
    metrics record every step, no evaluation, one thread. Only the parallel layout differs between runs."""
    return (
        FINAL_SAVE
        + ["--training.steps", str(steps), "--precision.compute", "fp32", "--training.eval_interval", "0"]
        + ["--metrics.log_interval", "1", "--metrics.progress", "false", "--metrics.tensorboard", "false"]
        + ["--training.threads", "1"]
    )


def single_process() -> list[str]:
    """The reference layout: every mesh dim of size 1 (dp_shard -1 is the one process), plain DDP."""
    single = ["--parallel.data_parallel", "ddp"]
    for dim in MESH_DIMS:
        single += [f"--parallel.{dim}", "-1" if dim == "dp_shard" else "1"]
    return single


@dataclass
class ParityResult:
    layout: str
    nproc: int
    max_loss_rel: float
    max_grad_norm_rel: float
    max_param_abs: float
    worst_param: str
    """The parameter with the largest absolute difference, or what is wrong with the names."""
    ok: bool
    error: str = ""
    """Why the layout's run (or reading its checkpoint) failed; empty when it ran."""


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


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    """The parameters of the run's newest checkpoint, by name, as whole CPU tensors (DCP reshards any layout)."""
    try:
        model, *_ = load_run_model(run_dir)
    except CheckpointException as e:  # e.g. a parameter the whole model has and the checkpoint lacks
        causes = sorted({str(exc) for exc, _ in e.failures.values()})
        raise UserError(
            f"the final checkpoint of {run_dir} does not load into the whole model: {causes}"
        ) from None
    return {name: t.detach() for name, t in model.state_dict().items()}


def param_diff(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest |got - ref| over every element of every parameter, and the name of the parameter it is in. A
    name in only one of them, or a shape that differs, is an infinite difference, named by what is wrong."""
    missing, extra = sorted(ref.keys() - got.keys()), sorted(got.keys() - ref.keys())
    if missing or extra:

        def listed(names: list[str]) -> str:
            return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")

        wrong = [
            f"{what} {listed(names)}" for what, names in (("missing", missing), ("extra", extra)) if names
        ]
        return math.inf, "; ".join(wrong)
    worst, worst_name = -1.0, ""
    for name in sorted(ref):
        a, b = got[name], ref[name]
        if a.shape != b.shape:
            return math.inf, f"{name} has shape {tuple(a.shape)}, the reference's {tuple(b.shape)}"
        d = (a.double() - b.double()).abs().max().item() if b.numel() else 0.0
        if not math.isnan(worst) and (math.isnan(d) or d > worst):  # a NaN stays the worst
            worst, worst_name = d, name
    return max(worst, 0.0), worst_name  # max() keeps a NaN


def format_result(r: ParityResult, rtol: float, atol: float) -> str:
    """One line per layout: its figures, and whether it passes."""
    head = f"{r.layout:40s} nproc {r.nproc}  "
    if r.error:
        return head + f"FAILED: {r.error}"
    return head + (
        f"max rel diff: loss {r.max_loss_rel:.2e}  grad norm {r.max_grad_norm_rel:.2e}  "
        f"max abs diff: params {r.max_param_abs:.2e} ({r.worst_param})  "
        f"{'OK' if r.ok else 'MISMATCH'} (rtol {rtol:g}, atol {atol:g})"
    )


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def compare_run(
    layout: str,
    nproc: int,
    ref: tuple[list[dict], dict],
    got: tuple[list[dict], dict],
    rtol: float,
    atol: float,
) -> ParityResult:
    """The verdict on one layout: `ref` and `got` are (per-step metrics records, final parameters by name)."""
    (ref_metrics, ref_params), (metrics, params) = ref, got
    dl = _max_rel([m["loss"] for m in metrics], [m["loss"] for m in ref_metrics])
    dg = _max_rel([m["grad_norm"] for m in metrics], [m["grad_norm"] for m in ref_metrics])
    dp, worst = param_diff(ref_params, params)
    return ParityResult(layout, nproc, dl, dg, dp, worst, dl <= rtol and dg <= rtol and dp <= atol)


def run_parity(
    config: str | None,
    layouts: list[str],
    steps: int,
    overrides: list[str],
    rtol: float,
    atol: float,
    out: Callable[[str], None] = print,
) -> list[ParityResult]:
    """fp32, deterministic kernels, metrics every step, no evaluation: only the parallel layout differs. Each run
    ends with a synchronous checkpoint in its own run directory (checkpoint.enabled/interval/async_save/storage
    are forced, so `--checkpoint.enabled false` does not skip it), read back into a whole model on this process.

    A layout passes when its losses and grad norms are within `rtol` of the reference's at every step and every
    final parameter within `atol` of it. atol, not rtol: AdamW divides by sqrt(v), so a sum merely reordered moves
    the update of a near-zero gradient by ~1e-5 over 10 steps (tests/distributed/reference.py PARAM_ATOL)."""
    if steps < 1 or rtol < 0 or atol < 0:
        raise ConfigError(
            f"parity needs --steps >= 1, --rtol >= 0, --atol >= 0 (got {steps}, {rtol}, {atol})"
        )
    settings = overrides + run_settings(steps)
    base = (["--config", config] if config else []) + settings
    parsed = [(layout, *parse_layout(layout)) for layout in layouts]
    single = single_process()
    runs = [("reference", settings + single, 1)] + [
        (f"layout {lay!r}", settings + a, n) for lay, n, a in parsed
    ]
    check_configs(config, runs)  # every layout's whole config, before any run
    results = []
    with tempfile.TemporaryDirectory(prefix="scaletrain-parity-") as tmp:
        ref_dir = Path(tmp) / "reference"
        ref = (run_train(base + single, 1, ref_dir), final_params(ref_dir))
        out(f"reference (1 process): final loss {ref[0][-1]['loss']:.6f}, {len(ref[1])} parameters")
        for i, (layout, nproc, layout_args) in enumerate(parsed):
            run_dir = Path(tmp) / f"layout{i}"
            try:
                got = (run_train(base + layout_args, nproc, run_dir), final_params(run_dir))
            except UserError as e:
                error = e.problems[0] if isinstance(e, ConfigError) else str(e)
                results.append(ParityResult(layout, nproc, math.inf, math.inf, math.inf, "", False, error))
            else:
                results.append(compare_run(layout, nproc, ref, got, rtol, atol))
            out(format_result(results[-1], rtol, atol))
    return results
