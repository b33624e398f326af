"""The in-memory tier on 4 gloo ranks, 2 on each of 2 nodes, with an FSDP-sharded model (DTensor state): a snapshot
survives a restart, every replica sits on the other node, a node whose shared memory is gone whole is restored from
the other node's replicas (also when the re-formed job numbers the nodes the other way round), a rank whose own copy
is damaged restores from its replica, and a rank with no intact copy left sends everyone to storage. A node here is a
hostname given to the tier and a directory of its own in real shared memory (/dev/shm); tests/cluster/
test_node_loss.py shows the same on nodes made with namespaces. One spawn runs the phases in order; each rank writes
what it saw, and each test checks one phase."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from scaletrain.checkpoint import LoaderState, ModelState, TrainState, memory_tier
from scaletrain.checkpoint.memory_tier import TENSORS, MemoryTier, make_layout_key
from scaletrain.config import ParallelConfig
from scaletrain.optim.optimizers import Optimizers, build_optimizer
from scaletrain.parallel.mesh import ParallelDims
from scaletrain.parallel.parallelize import parallelize
from tests.distributed.reference import OPT, full_model, tiny_args
from tests.distributed.spawn import spawn
from tests.fixtures import FakeLoader as Loader
from tests.fixtures import flip_bit

WORLD = 4
HOSTS = ["node-a", "node-a", "node-b", "node-b"]  # as torchrun numbers 2 nodes x 2 workers
FLIPPED = ["node-b", "node-b", "node-a", "node-a"]  # a re-formed job that numbered the nodes the other way
CPU = torch.device("cpu")


def _build(world_size: int, seed: int, train_steps: int, group) -> tuple[dict, dict]:
    """An FSDP model with AdamW after `train_steps` steps; returns the state dict for the tier and its parts."""
    pcfg = ParallelConfig(data_parallel="fsdp")
    dims = ParallelDims.from_config(pcfg, world_size)
    dims.build_mesh("cpu")
    args = tiny_args(n_layers=2)
    (model,) = parallelize(full_model(args, seed=seed), dims, pcfg, device=CPU, n_microbatches=1).parts
    optimizers = Optimizers([model], lambda m: build_optimizer(m, OPT), OPT, 100)
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    for _ in range(train_steps):
        x = torch.randint(0, args.vocab_size, (2, 9), generator=g)
        torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        optimizers.step()
    train, loader = TrainState(group), Loader()
    state = {
        "model": ModelState([model]),
        "optimizer": optimizers,
        "data": LoaderState(loader),
        "train": train,
    }
    opt, sched = optimizers.optimizers[0], optimizers.schedulers[0]
    return state, {"model": model, "opt": opt, "sched": sched, "loader": loader, "train": train}


def _local_tensors(parts: dict) -> dict[str, torch.Tensor]:
    """This rank's shards of the weights and AdamW moments, plus the scalars that resume."""
    out = {}
    for n, p in parts["model"].named_parameters():
        out[n] = (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for k, v in parts["opt"].state[p].items():
            out[f"{n}.{k}"] = (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
    t, ld = parts["train"], parts["loader"]
    out["scalars"] = torch.tensor([t.step, t.tokens, ld.next_sample, parts["sched"].last_epoch])
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _tier(name: str, layout: str, group, base: str, hosts: list[str] = HOSTS, **kw) -> MemoryTier:
    """This rank's tier on its node: the node's own directory in shared memory, and the node of every rank."""
    return MemoryTier(name, layout, group=group, root=f"{base}/{hosts[dist.get_rank()]}", hosts=hosts, **kw)


def _restarted(group, base: str, layout: str, hosts: list[str] = HOSTS) -> dict:
    """A restarted worker: new objects (other weights and moments) finding the snapshot in shared memory."""
    state, parts = _build(WORLD, seed=1, train_steps=1, group=group)
    before = _local_tensors(parts)
    tier = _tier("job", layout, group, base, hosts)
    step = tier.latest_complete_step()
    if step is not None:
        tier.restore(step, state)
    return {
        "step": step,
        "before": before,
        "tensors": _local_tensors(parts),
        "from_peer": tier.restored_from_peer,
        "from": {str(r): h for r, h in tier.restored_from.items()},
    }


def _lost_node(rank: int, group, base: str, layout: str, tier: MemoryTier, state: dict, parts: dict) -> dict:
    """A new snapshot (step 20), then node-b dies whole (its shared memory with it) and comes back empty; then it
    dies again and comes back numbered first (ranks 0 and 1): what each restart saw."""
    parts["train"].step, parts["train"].tokens, parts["loader"].next_sample = 20, 2000, 160
    assert tier.snapshot(20, state)
    want = _local_tensors(parts)
    seen = {}
    for case, hosts in (("lost_node", HOSTS), ("renumbered", FLIPPED)):
        dist.barrier(group)
        if rank == 0:
            shutil.rmtree(f"{base}/node-b")
        dist.barrier(group)
        got = _restarted(group, base, layout, hosts)
        own = _tier("job", layout, group, base, hosts).own
        seen[case] = {
            "step": got["step"],
            "identical": _same(got["tensors"], want),
            "from_peer": got["from_peer"],
            "from": got["from"],
            "healed": memory_tier._verify(own / "step-00000020") is None,
        }
    return seen


def _damaged_and_lost(
    rank: int, group, base: str, layout: str, tier: MemoryTier, state: dict, want: dict
) -> dict:
    """Copies damaged or lost one case after another, each followed by a restart; what each restart saw."""
    seen = {}
    # A damaged own copy (one bit of rank 0's file flipped in shared memory): rank 0 uses the replica on rank 2.
    if rank == 0:
        flip_bit(tier.own / "step-00000010" / TENSORS)
    dist.barrier(group)
    got = _restarted(group, base, layout)
    seen["damaged_own"] = {
        "step": got["step"],
        "identical": _same(got["tensors"], want),
        "from_peer": got["from_peer"],
        "from": got["from"],
        "healed": memory_tier._verify(tier.own / "step-00000010") is None,
    }

    # Both copies of rank 2's data gone (its own slot and rank 0's replica of it): nothing to restore from memory.
    if rank == 2:
        shutil.rmtree(tier.own)
    if rank == 0:
        shutil.rmtree(tier.replica)
    dist.barrier(group)
    seen["lost_both"] = _tier("job", layout, group, base).latest_complete_step()

    # A new snapshot, then both copies of rank 1's damaged (its own and rank 3's replica of it): storage.
    assert tier.snapshot(15, state)
    if rank == 1:
        flip_bit(tier.own / "step-00000015" / TENSORS, at=0.3)
    if rank == 3:
        flip_bit(tier.replica / "step-00000015" / TENSORS, at=0.7)
    dist.barrier(group)
    seen["damaged_both"] = {
        "step": _tier("job", layout, group, base).latest_complete_step(),
        "own_left": (tier.own / "step-00000015").is_dir(),
        "replica_left": (tier.replica / "step-00000015").is_dir(),
    }
    return seen


def worker(rank: int, world_size: int, base: str, out: str) -> None:
    torch.manual_seed(0)
    memory_tier._CHUNK = 64 << 10  # many messages per transfer, as a large state sends
    group = dist.new_group(backend="gloo")
    layout = make_layout_key(world_size, "dp_shard4 (fsdp)")
    seen = {}

    # Bound: only rank 0's state is too big, and every rank skips.
    big = {"x": {"t": torch.zeros(40_000 if rank == 0 else 10)}}
    seen["bound"] = _tier("bound", layout, group, base, max_bytes=100_000).snapshot(1, big)

    state, parts = _build(world_size, seed=0, train_steps=2, group=group)
    tier = _tier("job", layout, group, base)
    for step in (5, 10):
        parts["train"].step, parts["train"].tokens, parts["loader"].next_sample = step, 100 * step, 8 * step
        assert tier.snapshot(step, state)
    want = _local_tensors(parts)
    # The rank whose replica this rank holds keeps its own copy on its node (the same path under that node's root).
    peer_file = Path(base, HOSTS[tier.prev], tier.job_dir.relative_to(Path(base, HOSTS[rank])))
    peer_file = peer_file / f"rank{tier.prev}" / "step-00000010" / "tensors.safetensors"
    seen["placement"] = {"holder": tier.next, "holder_node": HOSTS[tier.next], "held": tier.prev}
    seen["slots"] = {
        "own": sorted(d.name for d in tier.own.iterdir()),
        "replica": sorted(d.name for d in tier.replica.iterdir()),
        "replica_equals_peer": (tier.replica / "step-00000010" / "tensors.safetensors").read_bytes()
        == peer_file.read_bytes(),
        "bytes_used": tier.bytes_used(),
    }
    dist.barrier(group)

    got = _restarted(group, base, layout)
    seen["restart"] = {
        "step": got["step"],
        "identical": _same(got["tensors"], want),
        "changed_before": got["before"].keys() == want.keys()
        and not any(torch.equal(got["before"][k], want[k]) for k in want if k != "scalars"),
        "from_peer": got["from_peer"],
    }
    seen["other_layout"] = _tier(
        "job", make_layout_key(world_size, "tp4"), group, base
    ).latest_complete_step()

    seen.update(_damaged_and_lost(rank, group, base, layout, tier, state, want))
    seen.update(_lost_node(rank, group, base, layout, tier, state, parts))
    tier.cleanup()  # ranks 0 and 1 remove node-a's snapshots, 2 and 3 node-b's
    seen["cleaned"] = not tier.job_dir.exists()
    tier.close()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(seen, f)


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("memory_tier")
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp
    base = shm / f"scaletrain-test-{uuid.uuid4().hex[:12]}"  # base/<node>: each node's shared memory
    try:
        spawn(worker, WORLD, str(base), str(tmp))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_bound_exceeded_on_one_rank_skips_on_all(seen):
    assert [s["bound"] for s in seen] == [False] * WORLD


def test_snapshot_keeps_newest_own_and_replica(seen):
    for s in seen:
        assert s["slots"]["own"] == s["slots"]["replica"] == ["step-00000010"]
        assert s["slots"]["replica_equals_peer"] and s["slots"]["bytes_used"] > 0


def test_every_replica_is_on_the_other_node(seen):
    """torchrun numbers a node's ranks contiguously; the ring r -> r+1 would keep ranks 0's and 2's replicas home."""
    assert [s["placement"]["holder"] for s in seen] == [2, 3, 0, 1]
    assert [s["placement"]["held"] for s in seen] == [2, 3, 0, 1]
    for r, s in enumerate(seen):
        assert s["placement"]["holder_node"] != HOSTS[r]


def test_restart_restores_identical_state_on_every_rank(seen):
    for r, s in enumerate(seen):
        assert s["restart"]["step"] == 10
        assert s["restart"]["changed_before"], "the restarted state must differ before restoring"
        assert s["restart"]["identical"], f"rank {r}"
        assert not s["restart"]["from_peer"]
        assert s["other_layout"] is None


def test_a_node_lost_whole_restores_from_the_other_nodes_replicas(seen):
    """node-b's shared memory gone whole (both of its ranks' own copies and the replicas it held): its ranks take
    their snapshots from node-a, identical, and their slots are whole again."""
    for r, s in enumerate(seen):
        assert s["lost_node"]["step"] == 20 and s["lost_node"]["identical"], f"rank {r}"
        assert s["lost_node"]["from_peer"] == (r in (2, 3))
        assert s["lost_node"]["from"] == {"2": 0, "3": 1}
        assert s["lost_node"]["healed"]


def test_a_node_lost_whole_restores_when_the_nodes_are_numbered_anew(seen):
    """The rendezvous orders nodes by hostname, so a replacement can take the survivor's ranks: node-a's ranks are
    now 2 and 3, and find their own copies and the replicas they hold under the slots of the old numbering."""
    for r, s in enumerate(seen):
        assert s["renumbered"]["step"] == 20 and s["renumbered"]["identical"], f"rank {r}"
        assert s["renumbered"]["from_peer"] == (r in (0, 1))
        assert s["renumbered"]["from"] == {"0": 2, "1": 3}
        assert s["renumbered"]["healed"]


def test_damaged_own_copy_restores_from_peer_replica(seen):
    for r, s in enumerate(seen):
        assert s["damaged_own"]["step"] == 10 and s["damaged_own"]["identical"], f"rank {r}"
        assert s["damaged_own"]["from_peer"] == (r == 0)
        assert s["damaged_own"]["from"] == {"0": 2}
        assert s["damaged_own"]["healed"]


def test_both_copies_lost_falls_back_to_storage(seen):
    assert [s["lost_both"] for s in seen] == [None] * WORLD
    assert all(s["cleaned"] for s in seen)


def test_both_copies_damaged_falls_back_to_storage_and_are_removed(seen):
    assert [s["damaged_both"]["step"] for s in seen] == [None] * WORLD
    assert not seen[1]["damaged_both"]["own_left"] and not seen[3]["damaged_both"]["replica_left"]
    assert seen[0]["damaged_both"]["own_left"] and seen[3]["damaged_both"]["own_left"]
