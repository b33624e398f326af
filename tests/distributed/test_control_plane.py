"""Control plane vs data plane: a real training run (checkpoints async and sync, the memory tier, stragglers,
spikes, preemption agreement, evaluation) issues no collective on the implicit default group. On GPUs the model's
groups are NCCL, which carries only CUDA tensors: a CPU flag or RNG row sent over one fails every multi-GPU run at
step 1, which no gloo-only run shows unless the group itself is checked, as here."""

from __future__ import annotations

import functools
import traceback

import pytest
import torch.distributed as dist

from scaletrain.validate import load_config
from tests.distributed.spawn import spawn
from tests.helpers import DEBUG

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "reduce_scatter_tensor",
    "gather_object",
    "all_to_all_single",
)


def _watch(found: list[str]) -> None:
    """Record every call from scaletrain's code of a torch.distributed collective on the default group."""
    for name in COLLECTIVES:
        fn = getattr(dist, name)

        @functools.wraps(fn)
        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            group = kwargs.get("group", kwargs.get("process_group"))
            # None: the implicit default group. (A mesh dim spanning the world is handed the world group by
            # DeviceMesh: that is explicit, and its tensors are the model's, on the device.)
            ours = [f for f in traceback.extract_stack()[:-1] if "/scaletrain/" in f.filename]
            where = ours[-1].filename.split("/scaletrain/")[-1] if ours else ""
            # The world group explicitly is still wrong for the control plane (checkpoints, resilience, the run
            # directory, the loop): their tensors are on the CPU, which the world's NCCL backend cannot carry.
            control = where.startswith(("checkpoint/", "resilience/", "run/", "train.py"))
            if ours and (group is None or (group is dist.group.WORLD and control)):
                found.append(f"{_name} from {where}:{ours[-1].lineno}")
            return _fn(*args, **kwargs)

        setattr(dist, name, wrapped)


def _train(rank: int, world_size: int, run_dir: str, extra: list[str]) -> None:
    from scaletrain.train import train

    found: list[str] = []
    _watch(found)
    args = ["--run.dir", run_dir, "--metrics.progress", "false", "--metrics.tensorboard", "false"]
    cfg = load_config(
        DEBUG, [*args, "--training.steps", "6", *extra], world_size=world_size, check_run_dir=False
    )
    train(cfg)
    assert not found, f"rank {rank}: collectives on the default group: {found}"


@pytest.mark.parametrize(
    "layout",
    [
        ["--parallel.data_parallel", "ddp", "--checkpoint.async_save", "true"],
        ["--parallel.data_parallel", "fsdp", "--checkpoint.async_save", "false"],
    ],
    ids=["ddp-async", "fsdp-sync"],
)
def test_no_collective_of_a_training_run_uses_the_default_group(tmp_path, layout):
    extra = [
        *layout,
        "--checkpoint.interval",
        "2",
        "--checkpoint.snapshot_interval",
        "3",
        "--resilience.straggler_factor",
        "3",
        "--resilience.straggler_interval",
        "2",
        "--resilience.spike_zscore",
        "6",
        "--training.eval_interval",
        "3",
        "--training.eval_sequences",
        "4",
    ]
    spawn(_train, 2, str(tmp_path / "run"), extra)
