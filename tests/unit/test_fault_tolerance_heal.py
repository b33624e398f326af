"""ReplicaGroup.step_start's bookkeeping around a heal, with torchft's Manager replaced by a stand-in (no torchft
needed): the step it returns, and the throughput window restarted only after a heal."""

from __future__ import annotations

from scaletrain.resilience.fault_tolerance import ReplicaGroup


class _Manager:
    """The quorum of two groups; `peer_step`: the peers' committed step when this group heals from them."""

    def __init__(self, group: ReplicaGroup, peer_step: int | None) -> None:
        self.group, self.peer_step = group, peer_step

    def start_quorum(self) -> None:
        if self.peer_step is not None:  # torchft calls the group's load_state_dict (_load) during the quorum
            self.group.healed_at = 1.0

    def num_participants(self) -> int:
        return 2

    def current_step(self) -> int:
        return self.peer_step


class _Loader:
    def state_dict(self) -> dict:
        return {"position": 0}


def _group(peer_step: int | None) -> tuple[ReplicaGroup, list[str]]:
    calls: list[str] = []
    g = ReplicaGroup.__new__(ReplicaGroup)  # without __init__: no torchft Manager, no servers
    g.healed_at, g.replicas, g._first_quorum, g.groups, g.final = None, 0, False, 2, 100
    g.state, g.manager = {"loader": _Loader()}, _Manager(g, peer_step)
    g._new_window = lambda: calls.append("new_window")

    def joined(step: int) -> None:
        calls.append(f"replica_joined {step}")
        g.healed_at = None

    g._joined = joined
    return g, calls


def test_a_heal_restarts_the_throughput_window_after_the_quorum():
    # Restarted from its checkpoint of step 5, the group asks for step 6; its peers are at 60: it runs 61, and the
    # window of its next record holds step 61 alone (the heal and the wait before it are not step time).
    g, calls = _group(peer_step=60)
    assert g.step_start(6) == 61
    assert calls == ["replica_joined 60", "new_window"]


def test_without_a_heal_the_window_goes_on():
    g, calls = _group(peer_step=None)
    assert g.step_start(6) == 6
    assert calls == []
