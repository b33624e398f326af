"""Simulated nodes on one machine (STYLE 14: a cluster is a test fixture). Each node is a network namespace with
its own address on a bridge, its own hostname (UTS namespace), its own /dev/shm (a tmpfs in a mount namespace) and
its own pids (a pid namespace, so a node can be killed whole); the run directory lies on the filesystem every node
sees, as a shared filesystem would. The bridge lives in a namespace of its own: nothing is added to the root
namespace, and the nodes' traffic never leaves the namespaces made here. Addresses come from 198.18.0.0/15 (RFC
2544's benchmarking range). Needs root, iproute2 and util-linux (tests/preflight.py installs them).

Also a command, to rehearse a launch on N simulated nodes before spending an allocation on it (docs/launching.md):
    python -m tests.cluster.nodes --nodes 2 -- torchrun ... --local-addr {addr} ... -m scaletrain train ...
`{addr}`, `{node}` (0, 1, ...), `{hostname}`, `{head}` (node 0's address) and `{is_host}` (true on node 0, else
false: torchrun's --rdzv-conf is_host) are filled in per node."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.helpers import FIXED_PEAK

ROOT = Path(__file__).resolve().parents[2]
SUBNET = "198.18"  # 198.18.C.K: C a cluster of this process, K the node (1, 2, ...)
_clusters = itertools.count()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def problem() -> str | None:
    """Why simulated nodes cannot be made here (they need root, iproute2 and namespaces), or None."""
    if os.geteuid() != 0:
        return "simulated nodes need root (network, mount and pid namespaces)"
    probe = subprocess.run(
        ["unshare", "--net", "--uts", "--pid", "--fork", "--mount", "true"], capture_output=True, text=True
    )
    return None if probe.returncode == 0 else f"unshare fails here: {probe.stderr.strip()}"


class Node:
    """One simulated host. `start` runs a command on it (one at a time); the node lives until `kill` or the
    cluster's end, its orphans with it."""

    def __init__(self, cluster: Cluster, index: int) -> None:
        self.cluster, self.index = cluster, index
        self.hostname = f"node{index}"
        self.netns = f"{cluster.tag}-n{index}"
        self.port = f"v{index}"  # its veth's end on the bridge
        self.address = f"{SUBNET}.{cluster.number}.{index + 1}"
        self.status = cluster.scratch / f"{self.hostname}.status"  # the command's exit status, once it ended
        self.init: subprocess.Popen | None = None
        self.init_pid = 0  # pid 1 of the node, as the root namespace numbers it

    def start(self, cmd: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> None:
        """Boot the node (a fresh /dev/shm and pid namespace) and run `cmd` from the project root on it."""
        assert self.init is None or self.init.poll() is not None, f"{self.hostname} is running"
        out = open(log, "ab") if log else None  # noqa: SIM115 (the node process holds it); None: this terminal
        self.status.unlink(missing_ok=True)
        init = [sys.executable, "-m", "tests.cluster.init", "--hostname", self.hostname, "--cwd", str(ROOT),
                "--status", str(self.status), "--hosts", str(self.cluster.hosts())]  # fmt: skip
        self.init = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--pid", "--fork",
             "--mount-proc", "--propagation", "private", *init, "--", *cmd],
            env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
        self.init_pid = self._child_of(self.init.pid)

    @staticmethod
    def _child_of(pid: int, timeout: float = 10.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in _pids():
                if _ppid(p) == pid:
                    return p
            time.sleep(0.02)
        raise RuntimeError(f"no child of {pid} after {timeout}s")

    def pids(self) -> list[int]:
        """Every live process of the node (root-namespace pids), its init included."""
        if not self.init_pid:
            return []
        ns = _pid_ns(self.init_pid)
        return [p for p in _pids() if ns is not None and _pid_ns(p) == ns and not _zombie(p)]

    def processes(self, pattern: str) -> list[int]:
        """The node's live processes, its init aside, whose command line contains `pattern`."""
        return [p for p in self.pids() if p != self.init_pid and pattern in _cmdline(p)]

    def dump_stacks(self) -> None:
        """Every worker (a child of the agent) prints its threads' stacks into the node's log (SIGUSR1: the
        handler scaletrain.launch installs), so that a drill that timed out shows where the node stood."""
        agent = self.agent()
        for pid in self.pids():
            if agent is not None and _ppid(pid) == agent:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
                time.sleep(0.3)  # one worker at a time: they share the log, and their lines would interleave

    def agent(self) -> int | None:
        """The command started on the node, while it lives: the init's child (torchrun's agent, in a launch)."""
        return next((p for p in self.pids() if _ppid(p) == self.init_pid), None)

    def wait(self, timeout: float) -> int:
        """The exit status of the command started on the node, once it has ended (the node lives on)."""
        deadline = time.monotonic() + timeout
        while not self.status.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.hostname}'s command still runs after {timeout:.0f}s")
            time.sleep(0.1)
        return int(self.status.read_text())

    def run(
        self, cmd: list[str], env: dict[str, str] | None = None, timeout: float = 60, check: bool = True
    ) -> subprocess.CompletedProcess:
        """Run `cmd` on the started node (its network, hostname, mounts and pids), as a shell on it would, from
        the project root, beside the node's command; returns its result (text)."""
        return subprocess.run(
            ["nsenter", "--target", str(self.init_pid), "--net", "--uts", "--mount", "--pid", f"--wd={ROOT}", "--", *cmd],
            env={**os.environ, **(env or {})}, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
            check=check,
        )  # fmt: skip

    def kill(self) -> None:
        """The node dies whole: SIGKILL of its init ends every process in it, and its /dev/shm is gone."""
        with contextlib.suppress(ProcessLookupError):
            if self.init_pid:
                os.kill(self.init_pid, signal.SIGKILL)
        if self.init is not None:
            self.init.wait(timeout=30)

    def cut(self) -> None:
        """A network partition: the node's link to the bridge goes down (its processes live on)."""
        _ip("-n", self.cluster.bridge, "link", "set", self.port, "down")

    def mend(self) -> None:
        """The link is whole again: up (after `cut`), at full rate (after `slow`)."""
        _ip("-n", self.cluster.bridge, "link", "set", self.port, "up")
        # Not checked: it fails, harmlessly, where no rate was set.
        subprocess.run(
            ["ip", "netns", "exec", self.netns, "tc", "qdisc", "del", "dev", "eth0", "root"],
            capture_output=True,
        )

    def slow(self, rate: str = "2mbit") -> None:
        """A slow link: a token bucket on the node's own end (egress), as a congested or degraded NIC."""
        subprocess.run(
            ["ip", "netns", "exec", self.netns, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
             "rate", rate, "burst", "32kbit", "latency", "400ms"],
            check=True, capture_output=True,
        )  # fmt: skip


class Cluster:
    """N simulated nodes on one bridge; a context manager that removes every namespace it made."""

    def __init__(self, n: int) -> None:
        self.number = next(_clusters) % 250
        self.tag = f"st{os.getpid()}c{self.number}"
        self.scratch = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
        self.bridge = f"{self.tag}-br"
        self.nodes = [Node(self, i) for i in range(n)]
        self._made: list[str] = []
        try:
            self._netns(self.bridge)
            _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge, "link", "set", "br0", "up")
            for node in self.nodes:
                self._netns(node.netns)
                _ip("-n", self.bridge, "link", "add", node.port, "type", "veth", "peer", "name", "eth0", "netns",
                    node.netns)  # fmt: skip
                _ip("-n", self.bridge, "link", "set", node.port, "master", "br0", "up")
                _ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", "eth0")
                _ip("-n", node.netns, "link", "set", "eth0", "up")
                _ip("-n", node.netns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def _netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def hosts(self) -> Path:
        """/etc/hosts for the nodes: localhost and every node by name (a node added later is in the file of the
        nodes started after it)."""
        path = self.scratch / "hosts"
        lines = ["127.0.0.1 localhost", *(f"{n.address} {n.hostname}" for n in self.nodes)]
        path.write_text("\n".join(lines) + "\n")
        return path

    def add_node(self) -> Node:
        """A node that was not there at the start (a replacement host with a new address)."""
        node = Node(self, len(self.nodes))
        self.nodes.append(node)
        self._netns(node.netns)
        _ip(
            "-n",
            self.bridge,
            "link",
            "add",
            node.port,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            node.netns,
        )
        _ip("-n", self.bridge, "link", "set", node.port, "master", "br0", "up")
        _ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", "eth0")
        _ip("-n", node.netns, "link", "set", "eth0", "up")
        _ip("-n", node.netns, "link", "set", "lo", "up")
        return node

    def close(self) -> None:
        for node in self.nodes:
            node.kill()
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made = []
        shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if (
            exc_type is not None
        ):  # a drill failed (a wait timed out, most often): where each node's workers stood
            for node in self.nodes:
                node.dump_stacks()
            time.sleep(0.5)
        self.close()


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _stat(pid: int) -> list[str]:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...


def _ppid(pid: int) -> int:
    fields = _stat(pid)
    return int(fields[1]) if fields else -1


def _zombie(pid: int) -> bool:
    fields = _stat(pid)
    return not fields or fields[0] in ("Z", "X")


def _pid_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[1], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd or (why := problem()):
        print(why if cmd else "give the command to run on every node after --", file=sys.stderr)
        return 2
    with Cluster(args.nodes) as cluster:
        head = cluster.nodes[0].address
        for node in cluster.nodes:
            fill = dict(addr=node.address, node=node.index, hostname=node.hostname, head=head,
                        is_host=str(node.index == 0).lower())  # fmt: skip
            node.start([a.format(**fill) for a in cmd])
            print(f"{node.hostname}: {node.address}", flush=True)
        try:
            return max(node.wait(timeout=float("inf")) for node in cluster.nodes)
        except KeyboardInterrupt:
            return 130


if __name__ == "__main__":
    sys.exit(main())


# The documented many-nodes launch (docs/launching.md), as each node types it: one torchrun agent a node, the
# rendezvous on node0 by name, the process groups' sockets on the cluster interface.
NODE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}


def torchrun(
    nnodes: str,
    nproc: int,
    *train_args: str,
    max_restarts: int = 0,
    rdzv_id: str = "job",
    config: str = "configs/debug.toml",
    endpoint: str = "node0:29400",
    rdzv_conf: str = "",
) -> list[str]:
    """`torchrun ... -m scaletrain train --config CONFIG ARGS` for one node of a simulated cluster (`rdzv_conf`:
    torchrun's --rdzv-conf, e.g. "last_call_timeout=5")."""
    conf = ["--rdzv-conf", rdzv_conf] if rdzv_conf else []
    return [str(Path(sys.executable).parent / "torchrun"), "--nnodes", nnodes, "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, *conf, "--rdzv-id", rdzv_id,
            "--max-restarts", str(max_restarts), "-m", "scaletrain", "train", "--config", config,
            "--metrics.progress", "false", *FIXED_PEAK, *train_args]  # fmt: skip
