"""The one spawn helper of the multi-process tests: run a function in N gloo processes on CPU.

Each rank gets RANK/WORLD_SIZE/LOCAL_RANK in its environment and an initialised default process group, one
thread, and raises on failure; the parent re-raises the first failure with that rank's traceback.

Ranks are forked from a forkserver that has imported torch and scaletrain once (per test process): a freshly
spawned interpreter paid ~3 s of imports per rank. The forkserver starts at the first spawn and keeps the environment
of that moment; a rank's own variables are set in `_entry`.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import free_port

# What every rank imports; a module that fails to import here is imported by the rank itself (forkserver skips it).
# torch._dynamo as the launcher's fork server preloads it (launch._start_fork_server): the model imports it at its
# first compile-disabled call, which inside test_init_peak's measured build counted its ~50 MiB of modules as the
# build's (fsdp4 grew 106.8 MiB against a bound of 88).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "scaletrain.train", "tests.distributed.reference"]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, errors) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args, timeout: float = 300) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` processes; fn must be importable (module level)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the forkserver starts (the first spawn of this process)
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, errors)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    if not errors.empty():
        rank, tb = errors.get()
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    codes = [p.exitcode for p in procs]
    if any(c != 0 for c in codes):
        raise AssertionError(f"ranks exited with {codes} (a hang past {timeout}s shows as a kill)")


def _gather_to_file(rank: int, world_size: int, fn: Callable, out: str, args: tuple) -> None:
    every: list = [None] * world_size
    dist.all_gather_object(every, fn(rank, world_size, *args))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(every, f)


def spawn_gathered(fn: Callable, world_size: int, out: str, *args, timeout: float = 300) -> list:
    """`spawn`, where `fn(rank, world_size, *args)` returns what that rank measured (JSON-able): the ranks' results
    in rank order, passed through the file `out`."""
    spawn(_gather_to_file, world_size, fn, out, args, timeout=timeout)
    with open(out) as f:
        return json.load(f)


def spawn_resident_peaks(fn: Callable, world_size: int, tmp_path_factory, name: str) -> list:
    """`spawn_gathered` for workers that measure their resident peak by resetting it (/proc/self/clear_refs, then
    VmHWM): skipped where the kernel offers no reset."""
    import pytest

    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs /proc/self/clear_refs (Linux) to reset the peak resident set")
    return spawn_gathered(fn, world_size, str(tmp_path_factory.mktemp(name) / "results.json"))
