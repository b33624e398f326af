"""A resume must continue the same run: the config of a new start is compared with the one the run directory
saved, key by key. What the checkpoint cannot continue with (the model's shape, the tokenizer, the data, the seed,
the sequence length) is refused; what a run may legitimately change on the way (the learning rate, the number of
steps) is refused unless `run.accept_changes` names it; how the run is executed (layout, checkpoints, metrics,
resilience) may change freely — checkpoints reshard into any layout."""

from __future__ import annotations

from scaletrain.config import RENAMED_KEYS

# Key prefixes, matched on whole dotted segments.
CANNOT_CHANGE = (
    "model",
    "data.tokenizer",
    "data.sources",
    "data.seq_len",
    "data.val_fraction",
    "data.streaming",  # another reader: the samples of every step change
    "training.seed",
    "precision.qat",  # fake quantisation changes the function the weights were trained for
    "precision.qat_group_size",
    "optimizer.name",  # the checkpoint holds that optimizer's state: AdamW's moments or Muon's momentum buffers
)
FREE = (
    "model.attention",  # which kernel computes the same attention
    "model.loss",  # chunked or whole: the same loss
    "memory",  # recompute and offload change what is kept, not what is computed
    "training.compile",
    "parallel",
    "checkpoint",
    "resilience",
    "metrics",
    "profile",
    "run",
    "data.cache_dir",
    "data.workers",
    "data.stream_cache_mb",
    "data.read_ahead",
    "training.threads",
    "training.device",
    "training.deterministic",
    "training.micro_batch",
    "training.eval_interval",
    "training.eval_sequences",
    "precision.mechanism",  # how the same dtype is applied, like the layout
    "precision.reduce_dtype",
    "precision.loss_scale_init",  # a resumed fp16 run continues from its checkpointed scale
    "fault_tolerance.group",  # each node's command names its own replica group and address (issue 34)
    "fault_tolerance.address",
    "fault_tolerance.lighthouse",
)


def flatten(d: dict, prefix: str = "") -> dict[str, object]:
    """{"a.b.c": value} of a nested config; lists (e.g. data.sources) stay one value."""
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def resume_problems(saved: dict, new: dict, accepted: list[str]) -> list[str]:
    """Every difference between the saved resolved config and the new one that the resume cannot take, each with
    what to do; [] when the new start continues the same run. Both are `to_dict` forms (None values dropped)."""
    old, now = flatten(saved), flatten(new)
    accepted = [RENAMED_KEYS.get(key, key) for key in accepted]  # a key named by its old name
    problems = []
    for key in sorted(set(old) | set(now)):
        was, is_ = old.get(key, "(unset)"), now.get(key, "(unset)")
        if was == is_ or _under(key, FREE):
            continue
        change = f"{key} was {was!r} in the saved run, now {is_!r}"
        if _under(key, CANNOT_CHANGE):
            problems.append(
                f"{change}: the checkpoint cannot continue with it (it changes the model or the sample order); "
                f"keep {key} = {was!r}, or start a new --run.dir"
            )
        elif not _under(key, tuple(accepted)):
            problems.append(
                f"{change}: to continue the run with the new value, add --run.accept_changes {key} "
                f"(or keep {key} = {was!r})"
            )
    return problems + _powersgd_problems(old, now) + _loss_scaler_problems(old, now)


def _loss_scaler_problems(old: dict, now: dict) -> list[str]:
    """fp16 resumes its loss scale from the checkpoint (precision/scaler.py): a run switched to fp16 mid-way finds
    none to load. Switching away from fp16 is a precision change like any other (run.accept_changes)."""
    was, is_ = old.get("precision.compute", "fp32"), now.get("precision.compute", "fp32")
    if is_ == "fp16" and was != "fp16":
        return [
            f"precision.compute was {was!r} in the saved run, now 'fp16': its checkpoints hold no loss-scaler "
            "state to resume; keep precision.compute, or start fp16 in a new --run.dir"
        ]
    return []


def _powersgd_problems(old: dict, now: dict) -> list[str]:
    """parallel.* is free, but PowerSGD resumes from its checkpointed error feedback and rank-r Q factors
    (parallel/comm.py): switching it on mid-run, or changing its rank, finds none to load. Switching it off is free."""
    key, rank = "parallel.grad_compression", "parallel.powersgd_rank"
    if now.get(key) != "powersgd" or (old.get(key) == "powersgd" and old.get(rank) == now.get(rank)):
        return []
    held = f"rank {old.get(rank)}" if old.get(key) == "powersgd" else "no"
    return [
        f"{key} = 'powersgd' with {rank} {now.get(rank)}, but this run's checkpoints hold {held} PowerSGD state "
        f"to continue from; keep {key} = {old.get(key, 'none')!r} (and {rank}), or start a new --run.dir"
    ]
