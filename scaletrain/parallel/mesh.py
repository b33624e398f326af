"""Process-group start-up and ParallelDims: the one object that knows the device mesh (no process-group globals;
components get the sub-mesh they need, passed explicitly). The sizes' tiling of the world is checked here; every
other rule of a layout, and its batch arithmetic, is in parallel/layout.py."""

from __future__ import annotations

import datetime
import logging
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from scaletrain.config import ParallelConfig
from scaletrain.errors import ConfigError, UserError
from scaletrain.hardware import pin_mmap_threshold, usable_cpus, uses_cuda

T = TypeVar("T")


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_pref: str, timeout_s: float = 600.0) -> DistEnv:
    """Join the process group that torchrun describes in the environment (gloo on CPU, NCCL on GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    check_restartable_store(os.environ)
    use_cuda = uses_cuda(device_pref)
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        # On GPUs the default group gets a gloo backend for CPU tensors beside NCCL for CUDA ones: NCCL serves only
        # CUDA tensors, and a CPU tensor on an NCCL-only group fails (torch accepts a per-device backend string).
        dist.init_process_group(
            backend="cuda:nccl,cpu:gloo" if use_cuda else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if use_cuda else None,
        )
    return DistEnv(rank, world, local_rank, local_world, device)


def setup_process(env: DistEnv, threads: int, deterministic: bool) -> None:
    """Per-process settings: rank 0 logs at INFO (the others only warnings), the intra-op thread count (0: the
    CPUs this process may use divided by the local processes), deterministic kernels, and fp32 that means fp32 on
    GPUs."""
    logging.basicConfig(
        level=logging.INFO if env.is_main else logging.WARNING,
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    torch.set_num_threads(threads or max(1, usable_cpus() // env.local_world_size))
    if env.device.type == "cpu":
        pin_mmap_threshold()  # freed tensors leave the resident set: the memory check's model (issue 35)
    if env.world_size == 1:
        # DCP warns on every single-process save and load that it assumes the intent is one process: it is.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
    if deterministic:
        # Same kernels, same reduction order, same thread count: bit-identical CPU runs. cuBLAS is deterministic
        # only with a fixed workspace (without it the first matmul raises under use_deterministic_algorithms).
        if env.device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if env.device.type == "cuda":
        # TF32 matmuls would silently compute with a 10-bit mantissa.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def check_restartable_store(env) -> None:
    """Refuse to start a worker that torchrun could restart into a hang.

    torchrun (torch 2.13) shares one TCP store between its agent and the workers of every attempt; the workers' keys
    (gloo's addresses) survive a restart, so a restarted group reads its dead predecessors' addresses and fails to
    connect. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each attempt a fresh store (`scaletrain train --nproc` sets
    it; a job launched with torchrun's own restarts must set it too)."""
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if shared and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        raise UserError(
            "torchrun restarts workers here (--max-restarts > 0) but shares its TCP store with them, so a "
            "restarted group would fail to connect (torch 2.13 keeps the previous attempt's keys). "
            "Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment on every node."
        )


# The world mesh's dimensions, outermost first. Pipeline stages are outermost (their traffic is the lightest:
# activations point to point); tensor parallel is innermost, so that its ranks are neighbours (same node, NVLink)
# for its per-layer collectives — the order of torchtitan's ParallelDims.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Flattened views of several dims, each for one consumer:
#   dp          — data loading: every rank of it reads a different slice of the global batch;
#   dp_shard_cp — FSDP sharding: context-parallel ranks hold different tokens of the same samples, so their
#                 gradients are summed like data-parallel ones and they can share the parameter shards too;
#   dp_cp       — loss averaging and DDP's gradient all-reduce.
FLAT_DIMS = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
# Expert parallel splits dp_shard in two, ep innermost (neighbouring ranks for its all-to-all, as tp):
#   ep        — the ranks that hold different experts of one MoE block and exchange tokens;
#   dp_mod_ep — the ranks that hold the same experts (dp_shard / ep of them): FSDP shards the experts over it.
EP_DIMS = ("dp_mod_ep", "ep")


@dataclass
class ParallelDims:
    """Sizes of the parallel dimensions (their product is the world size) and, once built, the device mesh."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1  # carved from dp_shard (not a factor of the world size): dp_shard = dp_mod_ep x ep
    mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    control: dist.ProcessGroup | None = field(default=None, init=False, repr=False, compare=False)
    """The control plane: one gloo group over the world for CPU tensors and objects (flags, RNG rows, run
    metadata); the device mesh carries the model's tensors. None on one process."""
    _flat: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_config(cls, pcfg: ParallelConfig, world_size: int) -> ParallelDims:
        """The sizes of `pcfg` with `dp_shard = -1` resolved to the rest of the world; raises ConfigError if the
        sizes cannot tile `world_size` (every other rule of a layout: parallel/layout.py)."""
        problems = tiling_problems(pcfg, world_size)
        if problems:
            raise ConfigError(problems)
        return cls(pcfg.dp_replicate, resolve_dp_shard(pcfg, world_size), pcfg.cp, pcfg.tp, pcfg.pp, pcfg.ep)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    def size(self, name: str) -> int:
        """Size of a mesh dim or a flattened one ("dp", "dp_shard_cp", "dp_cp"), or of "ep" and "dp_mod_ep"."""
        if name == "dp_mod_ep":
            return self.dp_shard // self.ep
        return math.prod(getattr(self, d) for d in FLAT_DIMS.get(name, (name,)))

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """Build the world mesh with every dim of MESH_DIMS (those of size 1 too, so `mesh["tp"]` always exists)
        and the flattened dims of FLAT_DIMS. One process needs no mesh: None, and every accessor copes."""
        if self.world_size == 1:
            self.mesh, self._flat, self.control = None, {}, None
            return None
        self.control = dist.new_group(backend="gloo")
        mesh = init_device_mesh(
            device_type, tuple(getattr(self, d) for d in MESH_DIMS), mesh_dim_names=MESH_DIMS
        )
        # Kept here rather than sliced back out of the root mesh by name (PyTorch deprecates that for flattened
        # dims).
        self._flat = {name: mesh[dims]._flatten(mesh_dim_name=name) for name, dims in FLAT_DIMS.items()}
        if self.ep > 1:
            # The same world re-split with dp_shard unflattened (one root mesh: FSDP joins the experts' dp_mod_ep
            # and ep dims into one 2-D mesh for their DTensors).
            sizes = (self.dp_shard // self.ep, self.ep)
            experts = mesh._unflatten(MESH_DIMS.index("dp_shard"), sizes, EP_DIMS)
            self._flat.update({name: experts[name] for name in EP_DIMS})
        self.mesh = mesh
        return mesh

    def submesh(self, name: str) -> DeviceMesh | None:
        """The 1-D mesh of one dim or flattened dim, or None on one process (e.g. `all_reduce_mean(loss,
        dims.submesh("dp_cp"))`); "ep" and "dp_mod_ep" exist only when ep > 1 (None otherwise)."""
        if self.mesh is None or (name in EP_DIMS and name not in self._flat):
            return None
        return self._flat[name] if name in self._flat else self.mesh[name]

    def hsdp_mesh(self) -> DeviceMesh:
        """The 2-D (dp_replicate, dp_shard_cp) mesh of HSDP: replicas outside, shards inside."""
        assert self.mesh is not None, "build_mesh first"
        if self.cp == 1:
            return self.mesh["dp_replicate", "dp_shard"]
        # Same ranks as dp_cp, re-split in two: the replicate groups, and the shard groups folding in cp. Built
        # once (it creates process groups, a collective call).
        if "hsdp" not in self._flat:
            self._flat["hsdp"] = self._flat["dp_cp"]._unflatten(
                0, (self.dp_replicate, self.dp_shard * self.cp), ("dp_replicate", "dp_shard_cp")
            )
        return self._flat["hsdp"]

    def local_rank(self, name: str) -> int:
        """This process's coordinate along a dim or flattened dim (0 on one process)."""
        mesh = self.submesh(name)
        return 0 if mesh is None else mesh.get_local_rank()

    # What the data loader needs: which slice of the global batch this rank reads, and of how many.
    def describe(self, pcfg: ParallelConfig) -> str:
        """The layout in one line, e.g. "pp2 x dp_shard2 (fsdp, 1f1b)", or "single process"."""
        sizes = [f"{n}{getattr(self, n)}" for n in MESH_DIMS if getattr(self, n) > 1]
        if not sizes:
            return "single process"
        extra = [pcfg.data_parallel] if self.dp_size * self.cp > 1 else []
        extra += [pcfg.pp_schedule] if self.pp > 1 else []
        extra += ["sequence-parallel"] if pcfg.sequence_parallel else []
        extra += [f"ep{self.ep}"] if self.ep > 1 else []
        return " x ".join(sizes) + (f" ({', '.join(extra)})" if extra else "")

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_rank(self) -> int:
        return self.local_rank("dp")

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1


def resolve_dp_shard(pcfg: ParallelConfig, world_size: int) -> int:
    """parallel.dp_shard with -1 resolved to the rest of the world (0 where the rest does not divide it)."""
    if pcfg.dp_shard != -1:
        return pcfg.dp_shard
    rest = pcfg.pp * pcfg.dp_replicate * pcfg.cp * pcfg.tp
    return world_size // rest if rest > 0 and world_size % rest == 0 else 0


def tiling_problems(pcfg: ParallelConfig, world_size: int) -> list[str]:
    """Why the sizes cannot tile `world_size` (each >= 1, their product the world); [] when they do."""
    bad = [
        f"parallel.{n} must be >= 1, got {getattr(pcfg, n)}"
        for n in ("dp_replicate", "tp", "pp", "cp", "ep")
        if getattr(pcfg, n) < 1
    ]
    if pcfg.dp_shard < 1 and pcfg.dp_shard != -1:
        bad.append(f"parallel.dp_shard must be >= 1 or -1 (the rest of the world), got {pcfg.dp_shard}")
    if bad:
        return bad
    sizes = f"pp {pcfg.pp} x dp_replicate {pcfg.dp_replicate} x cp {pcfg.cp} x tp {pcfg.tp}"
    if pcfg.dp_shard == -1:
        rest = pcfg.pp * pcfg.dp_replicate * pcfg.cp * pcfg.tp
        if world_size % rest:
            return [
                f"parallel.dp_shard = -1 fills the rest of the world, but {sizes} = {rest} does not divide the "
                f"world size {world_size}; change those sizes or the number of processes"
            ]
        return []
    product = pcfg.pp * pcfg.dp_replicate * pcfg.dp_shard * pcfg.cp * pcfg.tp
    if product != world_size:
        return [
            f"parallel sizes {sizes} x dp_shard {pcfg.dp_shard} = {product}, but the world has {world_size} "
            "processes; make the product equal the world size (dp_shard = -1 fills the rest)"
        ]
    return []


def all_reduce_mean(t: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """Mean of a tensor over the mesh (identity on one process)."""
    if mesh is None:
        return t
    t = t.detach().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=mesh.get_group())  # a 1-D mesh: never the default group
    return t / mesh.size()


def broadcast_object(obj: object, group: dist.ProcessGroup | None) -> object:
    """Rank 0's value of `obj` on every rank of a CPU (gloo) group, e.g. `dims.control` (identity for None)."""
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def any_rank(flag: bool, group: dist.ProcessGroup | None) -> bool:
    """True on every rank when `flag` is true on at least one rank of the CPU group (e.g. a SIGTERM seen by one)."""
    if group is None:
        return flag
    t = torch.tensor([float(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def main_first(is_main: bool, group: dist.ProcessGroup | None, fn: Callable[[], T]) -> T:
    """Run fn on rank 0, then on the others (e.g. tokenise once, then read the cache); a UserError on rank 0 is
    raised on every rank instead of leaving them waiting at a barrier until the timeout."""
    result, error = None, None
    if is_main:
        try:
            result = fn()
        except UserError as e:
            error = str(e)
    error = broadcast_object(error, group)
    if error is not None:
        raise UserError(error)
    return result if is_main else fn()
