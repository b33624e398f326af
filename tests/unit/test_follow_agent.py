"""A worker of the user's own torchrun ends with its agent (issue 41): resilience.preemption.follow_agent, in real
processes. The agent is stood in for by a Python parent (as torch's agent is one); its death comes from the kernel
(SIGKILL), and the parent that died before the worker set its signal is shown by a parent that is not Python."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

WORKER = (
    "from scaletrain.resilience.preemption import follow_agent; follow_agent(); print('armed', flush=True); "
)
AGENT = (
    "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', sys.argv[1]], stdout=subprocess.PIPE, "
    "text=True); print(p.pid, flush=True); print(p.stdout.readline().strip(), flush=True); p.wait()"
)
ELASTIC = {**os.environ, "TORCHELASTIC_RUN_ID": "test"}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_a_worker_dies_with_its_agent_killed_by_sigkill():
    agent = subprocess.Popen([sys.executable, "-c", AGENT, WORKER + "import time; time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True, env=ELASTIC)  # fmt: skip
    worker = int(agent.stdout.readline())
    assert agent.stdout.readline().strip() == "armed" and _alive(worker)
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait()
    deadline = time.monotonic() + 5
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(worker)
    if alive:
        os.kill(worker, signal.SIGKILL)
    assert not alive, "the worker outlived its agent"


def test_a_worker_whose_agent_was_gone_before_it_set_the_signal_exits_at_once():
    """Its parent is then an adopter (init, a subreaper, a shell), never a Python agent: here a shell."""
    done = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "$0"; true', WORKER + "print('trained')"],
                          capture_output=True, text=True, env=ELASTIC, timeout=60)  # fmt: skip
    assert "the torchrun agent that started this worker is gone" in done.stderr, done.stderr
    assert "armed" not in done.stdout and "trained" not in done.stdout


def test_nothing_changes_outside_an_elastic_agent():
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    done = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "$0"; true', WORKER + "print('trained')"],
                          capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    assert done.stdout.split() == ["armed", "trained"], done.stderr
