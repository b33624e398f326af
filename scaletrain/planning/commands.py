"""What `scaletrain plan`, `train --dry-run` and `--parallel.auto` do, for cli.py to call: the search over layouts,
the estimate of one layout, and the layout parallel.auto applies before validation (`plan --calibrate` is
calibrate.py's run_calibrate). The estimators they call are in scaletrain/planning/estimators/."""

from __future__ import annotations

import json
import os
import sys

import torch

from scaletrain.config import Config
from scaletrain.config.io import fields_typed, parse_config
from scaletrain.data import resolve_cache_dir
from scaletrain.errors import ConfigError
from scaletrain.hardware import busy_reason, gpu_count, uses_cuda
from scaletrain.parallel.layout import Layout, layout_problems
from scaletrain.planning.estimators.hardware import (
    GPUS,
    KINDS,
    UNCALIBRATED,
    DeviceProfile,
    cached_probe,
    load_profile,
    local_gpu_profile,
    profile_caveat,
)
from scaletrain.planning.estimators.inputs import model_args, parse_unvalidated
from scaletrain.planning.estimators.memory import PARTS, GiB
from scaletrain.planning.estimators.search import (
    Plan,
    device_bytes,
    estimate,
    format_table,
    memory_error,
    no_plan_message,
    pick,
    search,
)


def profile_for(cfg: Config, kind: str | None) -> DeviceProfile:
    """The profile of `kind`, or (None) of the device this config trains on: a known GPU by name, else the CPU. A CPU
    neither calibrated nor probed for this model and torch is probed now (planning/probe.py, seconds), except in a
    launched worker (its launcher probed) or where SCALETRAIN_PROBE=0 (the built-in defaults, as the tests plan)."""
    cache = resolve_cache_dir(cfg.data)
    if kind is None and uses_cuda(cfg.training.device):
        return local_gpu_profile(torch.cuda.get_device_name(0), cache)
    profile = load_profile(kind or "cpu", cache)
    if os.environ.get("SCALETRAIN_PROBE", "1") == "0" or "LOCAL_RANK" in os.environ:
        return profile  # a worker plans on what its launcher loaded, so that every rank picks the same layout
    why = cached_probe(cache)[1] if profile.source == UNCALIBRATED else None
    if profile.validated and profile.busy and busy_reason() is None:
        why = f"the cached one was measured on a busy machine ({profile.busy}) and it is quiet now"
    if why is None:
        return profile
    # Imported where a probe runs: it brings in the calibration's measurements, which a plan on a cached or
    # calibrated profile never needs (and, at module level, would put cli's import chain past its bound).
    from scaletrain.planning.probe import run_probe

    run_probe(cache, why)
    return load_profile("cpu", cache)


def plan_json(plan: Plan, profile: DeviceProfile) -> dict:
    out = plan.to_json()
    out.update(
        device=profile.name,
        profile_source=profile.source,
        fits=_fits(plan, profile),
        caveat=profile_caveat(profile),
    )
    out["device_memory_bytes"] = _have(plan, profile)
    return out


def _have(plan: Plan, profile: DeviceProfile) -> int:
    return device_bytes(profile, plan.world_size)


def _fits(plan: Plan, profile: DeviceProfile) -> bool:
    """As the memory check decides: on a CPU the estimate must fit with its stated error to spare."""
    return plan.memory["total"] * (1 + memory_error(profile)) <= _have(plan, profile)


def describe_estimate(plan: Plan, profile: DeviceProfile) -> str:
    """The estimate as printed by `plan --config` (without --json) and `train --dry-run`."""
    m, t = plan.memory, plan.time
    parts = ", ".join(f"{k.replace('_', ' ')} {m[k] / GiB:.3g}" for k in PARTS if m.get(k))
    comm = ", ".join(
        f"{k[:-2]} {t[k]:.3g}"
        for k in (
            "tp_comm_s",
            "cp_comm_s",
            "pp_p2p_s",
            "dp_comm_exposed_s",
            "bubble_s",
            "optimizer_s",
            "muon_s",
            "overhead_s",
        )
        if t.get(k)
    )
    fits = "fits" if _fits(plan, profile) else "DOES NOT FIT"
    if fits != "fits" and m["total"] <= _have(plan, profile):
        fits += f" (within the estimate's {100 * memory_error(profile):.0f}% error of the limit)"
    caveat = profile_caveat(profile)
    return (
        f"estimate on {profile.name} ({profile.source}):\n"
        f"  peak memory (fullest rank) {m['total'] / GiB:.3g} GiB of {_have(plan, profile) / GiB:.3g} GiB: {fits} "
        f"({parts})\n"
        f"  step time {t['step_time_s']:.4g} s (compute {t['compute_s']:.3g}{', ' + comm if comm else ''}); "
        f"{t['tokens_per_s']:.4g} tokens/s; MFU {100 * t['mfu']:.1f}%" + (f"\n  {caveat}" if caveat else "")
    )


def plan_one(
    cfg: Config, layout: Layout, kind: str | None, gpus_per_node: int | None
) -> tuple[Plan, DeviceProfile]:
    """The estimate of the config's own layout; ConfigError when the layout itself is refused."""
    args = model_args(cfg)
    problems = layout_problems(cfg, layout, args)
    if problems:
        raise ConfigError(problems)
    profile = profile_for(cfg, kind)
    return estimate(cfg, args, layout, profile, gpus_per_node), profile


def run_plan(
    *,
    config: str | None,
    overrides: list[str],
    model: str | None,
    devices: int | None,
    device: str | None,
    gpus_per_node: int,
    seq_len: int,
    global_batch_tokens: int,
    top: int,
    as_json: bool,
    nproc: int,
) -> int:
    if device is not None and device.lower() not in KINDS:
        raise ConfigError(f"--device '{device}' is unknown; choose one of {', '.join(KINDS)}")
    if model is None:
        cfg = parse_unvalidated(config, overrides)
        plan, profile = plan_one(
            cfg, Layout.of(cfg, nproc), device, gpus_per_node if device in GPUS else None
        )
        print(json.dumps(plan_json(plan, profile), indent=1) if as_json else describe_estimate(plan, profile))
        return 0
    _check_search_inputs(devices, seq_len, global_batch_tokens)
    kind = (device or "h100").lower()
    seeded = ["--model.preset", model, "--data.seq_len", str(seq_len), "--training.eval_interval", "0"]
    seeded += ["--precision.compute", "fp32" if kind == "cpu" else "bf16"]
    seeded += ["--training.global_batch_tokens", str(global_batch_tokens or seq_len * devices)]
    cfg = parse_unvalidated(config, seeded + overrides)
    args = model_args(cfg)
    profile = profile_for(cfg, kind)
    node = gpus_per_node if kind != "cpu" else profile.devices_per_node
    plans, rejected, example = search(cfg, args, devices, profile, node)
    gb = Layout.of(cfg, devices).global_batch
    if not plans:
        raise ConfigError(no_plan_message(devices, rejected, example, model, gb))
    if as_json:
        print(json.dumps([plan_json(p, profile) for p in plans[:top]], indent=1))
    else:
        print(f"{model} on {devices} x {profile.name}, seq {cfg.data.seq_len}, global batch {gb} sequences:")
        print(format_table(plans, rejected, example, top))
        if profile_caveat(profile):
            print(profile_caveat(profile))
    return 0


def _check_search_inputs(devices: int | None, seq_len: int, global_batch_tokens: int) -> None:
    """The search's own arguments, each problem with the value that would work (all at once, as validate does)."""
    problems = []
    if not devices or devices < 1:
        problems.append("plan --model needs --devices N (N >= 1)")
    if seq_len < 1:
        problems.append(f"--seq-len {seq_len} must be at least 1")
    elif global_batch_tokens < 0 or global_batch_tokens % seq_len:
        fix = max(1, round(global_batch_tokens / seq_len)) * seq_len
        problems.append(
            f"--global-batch-tokens {global_batch_tokens} is not a whole number of sequences of --seq-len "
            f"{seq_len}; use {fix} (or 0 for one sequence per device)"
        )
    if problems:
        raise ConfigError(problems)


def dry_run(cfg: Config, world: int) -> str:
    """What `train --dry-run` prints: the mesh, the batch arithmetic and the estimate (cfg already validated)."""
    layout = Layout.of(cfg, world)
    gb, micro, dp = layout.global_batch, layout.micro_batch, layout.dp_size
    accum = gb // (micro * dp)
    plan, profile = plan_one(cfg, layout, None, None)
    return (
        f"dry run: nothing started\n"
        f"mesh: {layout.dims().describe(cfg.parallel)} on {world} rank(s)\n"
        f"batch: global {gb} sequences x {cfg.data.seq_len} tokens = {gb * cfg.data.seq_len} tokens per step = "
        f"micro-batch {micro} x {dp} data-parallel rank(s) x {accum} accumulation step(s)\n"
        + describe_estimate(plan, profile)
    )


def auto_overrides(config: str | None, overrides: list[str], world: int) -> list[str]:
    """With parallel.auto true: the overrides plus the fastest fitting layout's (logged on rank 0), applied before
    validation; the overrides unchanged otherwise."""
    cfg, problems = parse_config(config, overrides)
    if not fields_typed(problems):
        raise ConfigError(problems)
    if not cfg.parallel.auto:
        return overrides  # load_config reports the unknown keys with the other problems
    args = model_args(cfg)
    profile = profile_for(cfg, None)
    node = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or (gpu_count() if profile.kind == "gpu" else 0)
    chosen = pick(cfg, args, world, profile, node or world)
    if os.environ.get("RANK", "0") == "0":
        print(
            f"parallel.auto chose: {chosen.describe()} (predicted {chosen.memory['total'] / GiB:.3g} GiB, "
            f"{chosen.time['step_time_s']:.3g} s per step, MFU {100 * chosen.time['mfu']:.1f}%)"
            + (f"; {profile_caveat(profile)}" if profile_caveat(profile) else ""),
            file=sys.stderr,
            flush=True,
        )
    return [*overrides, *chosen.overrides()]
