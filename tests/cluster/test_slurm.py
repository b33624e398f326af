"""A real Slurm (Debian's slurm-wlm and munge) on simulated nodes: slurmctld on node0, a slurmd on node1 and node2
(tests/cluster/slurm.py). The Slurm recipe, examples/slurm/train.sbatch, submitted as a user submits it."""

from __future__ import annotations

import pytest

from tests.cluster import nodes, slurm
from tests.cluster.nodes import Cluster
from tests.cluster.slurm import Slurm

why = nodes.problem() or slurm.problem()
pytestmark = pytest.mark.skipif(why is not None, reason=str(why))


@pytest.fixture(scope="module")
def cluster():
    with Cluster(3) as c:
        yield Slurm(c)


def test_srun_runs_on_both_compute_nodes(cluster):
    done = cluster.run(["srun", "--nodes", "2", "--ntasks-per-node", "1", "hostname"])
    assert sorted(done.stdout.split()) == ["node1", "node2"]
