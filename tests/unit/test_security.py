"""Security: the local rendezvous listens on loopback only, the memory tier's shared-memory folders are private and
its TTL cleanup never follows a link, and checkpoint metadata may name only DCP's own metadata types."""

from __future__ import annotations

import os
import socket
import stat
import time

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

from scaletrain import launch
from scaletrain.checkpoint import CheckpointManager, shm
from scaletrain.checkpoint.memory_tier import MemoryTier, default_root, remove_stale_jobs
from scaletrain.checkpoint.safe_load import UnsafeCheckpointError, read_metadata, safe_unpickle
from scaletrain.config import CheckpointConfig
from scaletrain.errors import UserError
from tests.fixtures import make_state


def _listening_addresses() -> list[str]:
    """The local addresses of this process's listening TCP sockets, as /proc/net/tcp{,6} spells them (hex)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1].split(":")[0])
    return found


def test_local_rendezvous_listens_on_loopback_only():
    """Both store servers of a one-node rendezvous, created as `scaletrain train --nproc N` creates them."""
    params = RendezvousParameters(
        backend=launch.LOCAL_RDZV,
        endpoint="127.0.0.1:0",
        run_id="security-test",
        min_nodes=1,
        max_nodes=1,
        local_addr="127.0.0.1",
    )
    handler = rendezvous_handler_registry.create_handler(params)
    info = handler.next_rendezvous()
    new = _listening_addresses()
    handler.shutdown()
    assert info.bootstrap_store_info.master_addr == "127.0.0.1"
    assert len(new) >= 2, new  # the rendezvous store and the one shared with the workers
    loopback = socket.inet_aton("127.0.0.1")[::-1].hex().upper()  # /proc/net/tcp is little-endian
    assert all(a == loopback for a in new), new


def test_run_workers_uses_loopback_rendezvous(monkeypatch, tmp_path):
    seen = {}

    def fake_launch(config, entrypoint):
        seen["config"] = config
        return lambda *args: None

    monkeypatch.setattr(launch, "elastic_launch", fake_launch)
    launch._run_workers(2, tmp_path, [])
    config = seen["config"]
    assert config.rdzv_backend == launch.LOCAL_RDZV
    assert config.rdzv_endpoint.startswith("127.0.0.1:")
    assert config.local_addr == "127.0.0.1"


def _pickle_naming(module: str, name: str) -> bytes:
    """A pickle that imports `module.name` (GLOBAL opcode) and calls it with no arguments."""
    return f"c{module}\n{name}\n)R.".encode()


@pytest.mark.parametrize(
    "module,name",
    [
        ("torch.distributed.checkpoint.filesystem", "FileSystemWriter"),
        ("torch.distributed.checkpoint.filesystem", "Path"),  # pathlib.Path, reachable through DCP's module
        ("torch.distributed.checkpoint.filesystem", "Future"),
        ("torch.distributed.checkpoint.planner", "LoadPlan"),
        ("torch.distributed.checkpoint", "FileSystemWriter"),
        ("pathlib", "Path"),
        ("concurrent.futures", "Future"),
    ],
)
def test_metadata_naming_anything_but_dcp_metadata_types_is_refused(tmp_path, module, name):
    with pytest.raises(UnsafeCheckpointError, match=f"{module}.{name}"):
        safe_unpickle(_pickle_naming(module, name))
    (tmp_path / ".metadata").write_bytes(_pickle_naming(module, name))
    with pytest.raises(UnsafeCheckpointError):
        read_metadata(str(tmp_path))


def test_real_checkpoint_metadata_still_loads(tmp_path):
    state, *_ = make_state()
    CheckpointManager(CheckpointConfig(async_save=False), str(tmp_path), state, rank=0, world_size=1).save(1)
    metadata = read_metadata(str(tmp_path / "step-00000001"))
    assert isinstance(metadata, Metadata)
    assert any(isinstance(m, TensorStorageMetadata) for m in metadata.state_dict_metadata.values())


def _age(path, seconds: float) -> None:
    for p in [path, *path.rglob("*")]:
        if not p.is_symlink():
            t = time.time() - seconds
            os.utime(p, (t, t))


def test_ttl_cleanup_never_follows_or_deletes_a_planted_link(tmp_path):
    victim = tmp_path / "victim"
    (victim / "rank0").mkdir(parents=True)
    (victim / "rank0" / "precious").write_text("x")
    _age(victim, 10 * 3600)
    root = tmp_path / "shm"
    stale = root / "stale-job"
    (stale / "rank0").mkdir(parents=True)
    (stale / "rank0" / "link-below").symlink_to(victim, target_is_directory=True)
    (root / "link-at-top").symlink_to(victim, target_is_directory=True)
    _age(stale, 10 * 3600)
    removed = remove_stale_jobs(root, ttl_s=3600)
    assert removed == ["stale-job"]
    assert (root / "link-at-top").is_symlink()
    assert (victim / "rank0" / "precious").read_text() == "x"


def test_root_and_snapshot_files_are_private(tmp_path):
    root = tmp_path / "shm"
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)
    tier = MemoryTier("job", "world=1|none", root=root)
    assert tier.snapshot(1, {"model": {"w": torch.ones(3)}, "step": {"n": 1}})
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700
    files = [p for p in root.rglob("*") if p.is_file()]
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), files


def test_default_root_is_per_user():
    assert default_root().name == f"scaletrain-{os.getuid()}"


def test_a_root_that_is_a_link_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "shm").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(UserError, match="symbolic link"):
        MemoryTier("job", "world=1|none", root=tmp_path / "shm")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(UserError, match="symbolic link"):
        MemoryTier("job", "world=1|none", root=tmp_path / "dangling")


def test_a_root_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    (tmp_path / "shm").mkdir()
    monkeypatch.setattr(shm.os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    with pytest.raises(UserError, match="belongs to user id"):
        MemoryTier("job", "world=1|none", root=tmp_path / "shm")
