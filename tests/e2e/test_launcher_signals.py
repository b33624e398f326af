"""Signals to the `scaletrain train --nproc 2` launcher, sent as a user or a scheduler sends them: SIGTERM to the
launcher or to its process group ends the job with a committed save and status 0, Ctrl-C with 130, neither with a
traceback; after `kill -9` of the launcher no worker lives on. Each start's worker logs lie flat in their own folder."""

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

from tests.helpers import DEBUG, QUICK, events, start_cli

TAG = "SCALETRAIN_TEST_TAG"  # in the environment of the launcher and of every process it starts
ARGS = [
    *QUICK,
    "--nproc",
    "2",
    "--training.steps",
    "1000000",  # still training when the signal lands
    "--checkpoint.interval",
    "0",  # the only save is the one the stop makes
    "--training.eval_interval",
    "0",
    "--metrics.log_interval",
    "1",
]


class Launcher:
    """`scaletrain train --nproc 2` in a session of its own (its process group, as a terminal's job or a batch
    script has), its output in a file; every process it starts carries its tag in the environment."""

    def __init__(self, run: Path, out: Path) -> None:
        self.run, self.out, self.tag = run, out, uuid.uuid4().hex
        metrics = run / "metrics.jsonl"
        self.logged = metrics.read_bytes().count(b"\n") if metrics.exists() else 0
        with open(out, "w") as f:
            self.proc = start_cli("train", "--config", DEBUG, "--run.dir", str(run), *ARGS, stdout=f,
                                  stderr=subprocess.STDOUT, env={**os.environ, TAG: self.tag},
                                  start_new_session=True)  # fmt: skip

    def wait_training(self, timeout: float = 180) -> None:
        """Until this start has logged two steps of its own."""
        deadline = time.monotonic() + timeout
        metrics = self.run / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_bytes().count(b"\n") >= self.logged + 2):
            assert self.proc.poll() is None, f"exited {self.proc.returncode}:\n{self.output()[-5000:]}"
            assert time.monotonic() < deadline, f"not training after {timeout} s:\n{self.output()[-5000:]}"
            time.sleep(0.05)

    def signal_and_wait(self, send, timeout: float = 60) -> float:
        """Send the signal (send(pid)); return the seconds until the launcher exited."""
        t0 = time.monotonic()
        send(self.proc.pid)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"still running {timeout} s after the signal:\n{self.output()[-5000:]}"
            ) from None
        return time.monotonic() - t0

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def processes(self) -> list[int]:
        """Live processes of this launch (the launcher, the fork server, the workers): their environment holds the
        tag. A zombie's environment reads empty."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if self.tag.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                    found.append(int(pid))
            except OSError:  # gone, or not ours
                pass
        return found

    def wait_gone(self, timeout: float) -> float:
        """Seconds until no process of this launch is left; fails after `timeout`."""
        t0 = time.monotonic()
        while left := self.processes():
            assert time.monotonic() - t0 < timeout, f"still alive {timeout} s on: {left}"
            time.sleep(0.05)
        return time.monotonic() - t0

    def kill_all(self) -> None:
        """Cleanup after a failed test: no trainer left running on the CI machine."""
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)


def _committed(run: Path, step: int) -> bool:
    return (run / "checkpoints" / f"step-{step:08d}" / "commit.json").is_file()


def test_sigterm_to_the_launcher_or_its_process_group_saves_and_exits_0(tmp_path):
    run = tmp_path / "run"
    senders = {
        "launcher": lambda pid: os.kill(pid, signal.SIGTERM),
        "group": lambda pid: os.killpg(pid, signal.SIGTERM),
    }
    first_logs = None
    for start, (to, send) in enumerate(senders.items(), 1):
        launcher = Launcher(run, tmp_path / f"{to}.out")
        try:
            launcher.wait_training()
            seconds = launcher.signal_and_wait(send)
            out = launcher.output()
            assert launcher.proc.returncode == 0, f"SIGTERM to the {to}:\n{out[-5000:]}"
            # The agent's SIGKILL came 30 s after the signal, and its exit after that.
            assert seconds < 20, f"SIGTERM to the {to}: exited after {seconds:.1f} s"
            assert "Traceback" not in out, out
            stop = events(run, "preempted")[-1]
            saved = [e for e in events(run, "checkpoint_saved") if e["step"] == stop["step"]]
            assert len(events(run, "preempted")) == start and saved and _committed(run, stop["step"])
            gone = launcher.wait_gone(10)
            print(f"SIGTERM to the {to}: exit 0 after {seconds:.2f} s, every process gone {gone:.2f} s later")
        finally:
            launcher.kill_all()
        # Flat logs, one folder per start: logs/start-N/attempt-A/rank-R.{stdout,stderr}.log.
        attempt = run / "logs" / f"start-{start}" / "attempt-0"
        names = sorted(p.name for p in attempt.iterdir())
        assert names == ["rank-0.stderr.log", "rank-0.stdout.log", "rank-1.stderr.log", "rank-1.stdout.log"]
        assert "SIGTERM: stopping after step" in (attempt / "rank-0.stderr.log").read_text()
        if first_logs is None:
            first_logs = {p.name: p.read_bytes() for p in attempt.iterdir()}
    # The second start continued from the first one's save, and wrote its logs beside the first's.
    starts = events(run, "start")
    assert starts[1]["resumed"] and starts[1]["step"] == events(run, "preempted")[0]["step"]
    assert sorted(p.name for p in (run / "logs").iterdir()) == ["start-1", "start-2"]
    first = run / "logs" / "start-1" / "attempt-0"
    assert {p.name: p.read_bytes() for p in first.iterdir()} == first_logs


def test_ctrl_c_to_the_process_group_saves_and_exits_130(tmp_path):
    run = tmp_path / "run"
    launcher = Launcher(run, tmp_path / "out")
    try:
        launcher.wait_training()
        seconds = launcher.signal_and_wait(lambda pid: os.killpg(pid, signal.SIGINT))
        out = launcher.output()
        assert launcher.proc.returncode == 130, out[-5000:]
        assert "interrupted (Ctrl-C)" in out and "Traceback" not in out, out
        assert seconds < 20, f"exited after {seconds:.1f} s"
        print(f"Ctrl-C: exit 130 after {seconds:.2f} s")
        # As without --nproc: every rank stopped after the same step and saved it, so the run continues from there.
        (stop,) = events(run, "preempted")
        (saved,) = events(run, "checkpoint_saved")
        assert (
            saved["step"] == stop["step"]
            and (run / "checkpoints" / f"step-{stop['step']:08d}" / "commit.json").is_file()
        )
        assert "to continue this run: scaletrain train" in out
        launcher.wait_gone(10)
    finally:
        launcher.kill_all()


def test_kill_9_of_the_launcher_takes_its_workers_with_it(tmp_path):
    run = tmp_path / "run"
    launcher = Launcher(run, tmp_path / "out")
    try:
        launcher.wait_training()
        assert (
            len(launcher.processes()) >= 4
        )  # the launcher, the fork server, two workers (a resource tracker)
        launcher.signal_and_wait(lambda pid: os.kill(pid, signal.SIGKILL))
        seconds = launcher.wait_gone(10)
        metrics = run / "metrics.jsonl"
        logged = metrics.read_bytes()
        time.sleep(1)
        assert metrics.read_bytes() == logged  # nothing trains on into the run directory
        print(f"every process gone {seconds:.2f} s after the launcher's SIGKILL")
    finally:
        launcher.kill_all()
