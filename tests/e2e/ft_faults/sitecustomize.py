"""Deaths inside torchft's own calls, for tests/e2e/test_fault_tolerance.py only (issue 34: "a death inside the
cross-group all-reduce", "a peer dying during a heal transfer"). The test puts this folder on the job's PYTHONPATH
with FT_FAULTS_ENV set, so Python imports it at every start (site's sitecustomize) and it wraps torchft where the
failure happens; scaletrain's code has no hook for it. Each death is a SIGKILL of the process (what a lost node
looks like to its peers), fires once per job (a marker file made first) and prints "... at step N" for the
launcher's diagnosis, as resilience.inject's kill does.

FT_FAULTS_ENV is JSON: {"dir": markers, "allreduce": {"group": G, "rank": R, "step": S, "call": C},
"heal": {"group": G, "rank": R}}; either fault may be left out. rank: the rank within its group."""

from __future__ import annotations

import json
import os
import signal
import sys

FT_FAULTS_ENV = "SCALETRAIN_TEST_FT_FAULTS"


def _here(fault: dict) -> bool:
    """Whether this process is the fault's rank: a worker of its group (the launcher and fork server are not)."""
    return os.environ.get("SCALETRAIN_FT_GROUP") == str(fault["group"]) and os.environ.get("RANK") == str(
        fault["rank"]
    )


def _first(markers: str, name: str) -> bool:
    """Whether fault `name` has not fired yet in this job; it has from now on (the restarted process lives)."""
    try:
        os.close(os.open(os.path.join(markers, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _die(what: str) -> None:
    print(f"injected test fault: SIGKILL {what}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _install(spec: dict) -> None:
    from torchft.checkpointing import http_transport
    from torchft.manager import Manager

    markers = spec["dir"]
    if kill := spec.get("allreduce"):
        real_allreduce, calls = Manager.allreduce, {}

        def allreduce(self, tensor, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            work = real_allreduce(self, tensor, *args, **kwargs)  # issued: the peers are in it with this rank
            step = self.current_step() + 1  # torchft counts committed steps; this is the one being trained
            calls[step] = calls.get(step, 0) + 1
            if (
                (step, calls[step]) == (kill["step"], kill["call"])
                and _here(kill)
                and _first(markers, "allreduce")
            ):
                _die(f"inside the cross-group all-reduce (call {calls[step]}) at step {step}")
            return work

        Manager.allreduce = allreduce
    if heal := spec.get("heal"):
        real_load = http_transport._streaming_load  # what reads the peer's state off the HTTP response

        def load(stream, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if _here(heal) and _first(markers, "heal"):
                # The transfer is under way: the first bytes of the peer's state have arrived.
                stream.read(4096)
                _die("while receiving a live peer's state (healing)")
            return real_load(stream, *args, **kwargs)

        http_transport._streaming_load = load


if value := os.environ.get(FT_FAULTS_ENV):
    _install(json.loads(value))
