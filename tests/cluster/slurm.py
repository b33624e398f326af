"""A real Slurm on simulated nodes (tests/cluster/nodes.py): slurmctld on node0, a slurmd on each other node, each
node with its own munged and the cluster's one munge key, as on a real cluster. Debian's slurm-wlm and munge
(tests/preflight.py installs them). Without cgroups (a node here is a set of namespaces, not a cgroup tree): Slurm
tracks a job's processes by their parent pids (proctrack/linuxproc) and binds no tasks (task/none). Every file
the daemons keep (state, spool, logs, the config) lies in the cluster's scratch directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from tests.cluster.nodes import Cluster, Node

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch")


def problem() -> str | None:
    """Why a Slurm cluster cannot be made here (the daemons are not installed), or None."""
    lacking = [d for d in DAEMONS if shutil.which(d) is None]
    return f"slurm-wlm and munge are not installed (no {', '.join(lacking)})" if lacking else None


def _conf(cluster: Cluster, dir: Path) -> str:
    ctld, *computes = cluster.nodes
    cpus = os.cpu_count() or 1
    return "\n".join(
        [
            "ClusterName=sim",
            f"SlurmctldHost={ctld.hostname}({ctld.address})",
            "SlurmUser=root",
            "AuthType=auth/munge",
            # How long a requeued job waits before it may start again (120 s by default; 5 is the least).
            "AuthInfo=cred_expire=5",
            "CredType=cred/munge",
            f"StateSaveLocation={dir}/slurmctld",
            f"SlurmdSpoolDir={dir}/slurmd-%n",
            f"SlurmctldPidFile={dir}/slurmctld.pid",
            f"SlurmdPidFile={dir}/slurmd-%n.pid",
            f"SlurmctldLogFile={dir}/slurmctld.log",
            f"SlurmdLogFile={dir}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # A namespace node has no cgroup tree of its own: processes are tracked by parentage, tasks not bound.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            # A requeued job may start once cred_expire has passed, but nothing then wakes the scheduler: the
            # periodic passes pick it up, every 60 s (main loop) and 30 s (backfill) by default. Each pass here
            # costs a few milliseconds for the one or two jobs of a test.
            "SchedulerParameters=sched_interval=1,bf_interval=1",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            # A node whose slurmd comes back (a replacement after a node was killed) is taken in again at once.
            "ReturnToService=2",
            # Every node says it has the machine's CPUs: the nodes share them, as the daemons cannot tell.
            "SlurmdParameters=config_overrides",
            "SlurmdTimeout=10",
            "MessageTimeout=5",
            "KillWait=30",
            "InactiveLimit=0",
            "MinJobAge=600",
            *(f"NodeName={n.hostname} NodeAddr={n.address} CPUs={cpus} State=UNKNOWN" for n in computes),
            f"PartitionName=main Nodes={','.join(n.hostname for n in computes)} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


class Slurm:
    """slurmctld on the cluster's node0 and a slurmd on each other node; `run` a Slurm command on node0 (the login
    node). `restart(node)` boots a killed compute node again with its slurmd."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.dir = cluster.scratch / "slurm"
        self.dir.mkdir(mode=0o700)
        self.conf = self.dir / "slurm.conf"
        self.conf.write_text(_conf(cluster, self.dir))
        (self.dir / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        self.key = self.dir / "munge.key"
        self.key.write_bytes(os.urandom(128))
        self.key.chmod(0o400)
        self.env = {"SLURM_CONF": str(self.conf)}
        ctld, *computes = cluster.nodes
        self._boot(ctld, "slurmctld -D -i")
        self.wait(lambda: self.run(["sinfo"], check=False).returncode == 0, 30, "slurmctld does not answer")
        for node in computes:
            self._boot(node, "slurmd -D")
        self.wait(self.idle, 30, "the compute nodes are not idle")

    def _boot(self, node: Node, daemon: str) -> None:
        # The node's own munged on the default socket (a tmpfs over /run/munge in the node's own mounts).
        d = self.dir
        (d / f"slurmd-{node.hostname}").mkdir(exist_ok=True)
        script = (f"mkdir -p /run/munge && mount -t tmpfs tmpfs /run/munge && "
                  # `ip netns exec` gives the node a fresh /sys, whose /sys/fs/cgroup is empty; slurmd loads its
                  # cgroup plugin whatever else is configured, and stops on "No filesystem mounted on
                  # /sys/fs/cgroup". cgroup/v1 loads over an empty tmpfs (and nothing here uses it).
                  f"mount -t tmpfs cgroup /sys/fs/cgroup && "
                  f"munged --force --key-file={self.key} --log-file={d}/munged-{node.hostname}.log "
                  f"--seed-file={d}/munged-{node.hostname}.seed && exec {daemon}")  # fmt: skip
        node.start(["bash", "-c", script], env=self.env, log=d / f"{node.hostname}.out")

    def restart(self, node: Node) -> None:
        self._boot(node, "slurmd -D")

    def run(self, cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
        return self.cluster.nodes[0].run(cmd, env=self.env, check=check, **kw)

    def idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split()
        return len(out) == 2 * (len(self.cluster.nodes) - 1) and all(s == "idle" for s in out[1::2])

    @staticmethod
    def wait(what, timeout: float, why: str):
        deadline = time.monotonic() + timeout
        while not (value := what()):
            assert time.monotonic() < deadline, why
            time.sleep(0.2)
        return value
