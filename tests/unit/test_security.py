"""Security: the local rendezvous listens on loopback only, the memory tier's shared-memory folders are private and
its TTL cleanup never follows a link, and checkpoint metadata may name only DCP's own metadata types."""

from __future__ import annotations

import os
import socket

from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

from scaletrain import launch


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
        backend=launch.LOOPBACK_RDZV,
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
    assert config.rdzv_backend == launch.LOOPBACK_RDZV
    assert config.rdzv_endpoint.startswith("127.0.0.1:")
    assert config.local_addr == "127.0.0.1"
