"""The user's form (issue 21): commands typed as README.md and docs/ give them, from a working directory that is
not the checkout, with relative paths, without --run.dir, with the defaults. A resume is proven by the step the
run started at (a deterministic restart from step 0 has the same losses)."""

import argparse
import re
import shlex
import signal
import time
from pathlib import Path

import pytest

from scaletrain.cli import _overrides_only, build_parser
from scaletrain.config import Config
from scaletrain.config.io import all_keys
from scaletrain.errors import STOPPED_EXIT_CODE
from tests.helpers import DEBUG, QUICK, ROOT, events, losses, run_cli, start_cli

# Six deterministic steps, each logged, a checkpoint every three.
SIX = ["--training.steps", "6", "--checkpoint.interval", "3", "--metrics.log_interval", "1",
       "--training.eval_interval", "0", "--training.deterministic", "true"]  # fmt: skip


def starts(run: Path) -> list[int]:
    return [e["step"] for e in events(run, "start")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The six steps in one go: what every split run must reproduce."""
    cwd = tmp_path_factory.mktemp("user")
    run_cli("train", "--config", DEBUG, "--run.dir", "runs/full", *QUICK, *SIX, cwd=cwd)
    return losses(cwd / "runs" / "full")


@pytest.mark.parametrize("storage", ["", "store", "file://{cwd}/url-store"])
def test_a_relative_run_dir_stopped_and_typed_again_continues_where_it_stopped(tmp_path, reference, storage):
    """Issue 21 (1): a relative run dir, a relative checkpoint.storage and a file:// URL were never resumed: the
    second start trained from step 0 again and overwrote the checkpoints."""
    store = ["--checkpoint.storage", storage.format(cwd=tmp_path)] if storage else []
    cmd = ["train", "--config", DEBUG, "--run.dir", "runs/split", *QUICK, *SIX, *store]
    first = run_cli(*cmd, "--run.stop_at_step", "3", cwd=tmp_path, check=False)
    assert first.returncode == STOPPED_EXIT_CODE and "Traceback" not in first.stderr
    line = re.search(r"to continue this run: (.*)", first.stderr).group(1)
    assert "--run.stop_at_step" not in line and "--run.dir runs/split" in line
    run_cli(*shlex.split(line)[1:], cwd=tmp_path)  # the printed command, as typed
    run = tmp_path / "runs" / "split"
    assert starts(run) == [0, 3]  # continued at step 3, not retrained from 0
    assert losses(run) == reference
    assert len(events(run, "checkpoint_loaded")) == 1 and events(run, "checkpoint_rejected") == []


def test_the_same_command_without_run_dir_continues_its_run_and_the_tools_read_it_from_anywhere(tmp_path):
    """Issue 21 (3, 11): without --run.dir, typing the command again started a new run at step 0; a finished run
    started again wrote a new end event; generate/eval/convert/report read a run from another directory."""
    cmd = ["train", "--config", DEBUG, *QUICK, *SIX]
    assert run_cli(*cmd, "--run.stop_at_step", "3", cwd=tmp_path, check=False).returncode == STOPPED_EXIT_CODE
    run_cli(*cmd, cwd=tmp_path)
    (run,) = (tmp_path / "runs").iterdir()
    assert run.name.startswith("debug-") and starts(run) == [0, 3]
    before = (run / "events.jsonl").read_bytes()
    again = run_cli(*cmd, cwd=tmp_path)
    assert "finished at step 6 of 6: nothing to train, nothing changed" in again.stdout
    assert (run / "events.jsonl").read_bytes() == before and len(list((tmp_path / "runs").iterdir())) == 1
    # The tools, from another directory, on the run as a relative path.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    rel = f"../runs/{run.name}"
    assert run_cli("generate", rel, "--prompt", "def ", "--max-new-tokens", "4", cwd=elsewhere).stdout
    (elsewhere / "text.txt").write_text("def f(x):\n    return x + 1\n" * 40)
    assert "perplexity" in run_cli("eval", rel, "--data", "text.txt", "--seq-len", "32", cwd=elsewhere).stdout
    assert "exported" in run_cli("convert", "--to", "hf", rel, "hf", cwd=elsewhere).stdout
    assert (elsewhere / "hf" / "config.json").is_file()
    assert "index.html" in run_cli("report", rel, cwd=elsewhere).stdout


def test_a_run_whose_checkpoints_are_all_damaged_is_refused_not_retrained(tmp_path):
    """Issue 21 (2): a run with commit markers and none intact trained from step 0 and overwrote its checkpoints.
    It is refused with each reason; run.start_over trains it again, keeping the damaged checkpoint aside."""
    cmd = ["train", "--config", DEBUG, "--run.dir", "runs/r", *QUICK, *SIX]
    run_cli(*cmd, "--run.stop_at_step", "3", cwd=tmp_path, check=False)
    ckpt = tmp_path / "runs" / "r" / "checkpoints" / "step-00000003"
    shard = next(ckpt.glob("*.distcp"))
    damaged = bytearray(shard.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    shard.write_bytes(bytes(damaged))
    refused = run_cli(*cmd, cwd=tmp_path, check=False)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "none is intact" in refused.stderr and "does not match its checksum" in refused.stderr
    assert "--run.start_over true" in refused.stderr
    assert shard.read_bytes() == bytes(damaged) and starts(tmp_path / "runs" / "r") == [0]
    run_cli(*cmd, "--run.start_over", "true", cwd=tmp_path)
    assert starts(tmp_path / "runs" / "r") == [0, 0]
    (aside,) = (tmp_path / "runs" / "r" / "checkpoints").glob("rejected-step-00000003-*")
    assert (aside / shard.name).read_bytes() == bytes(damaged)


def _documented_commands() -> list[tuple[str, list[str]]]:
    """Every `scaletrain ...` line of README.md and docs/*.md, as (where, argv)."""
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines = doc.read_text().splitlines()
        for n, line in enumerate(lines, 1):
            text = line.strip().removeprefix("$ ")
            while text.endswith("\\") and n < len(lines):  # a command continued on the next line
                text, n = text[:-1] + lines[n].strip(), n + 1
            if (
                re.match(r"(scaletrain|torchrun .*-m scaletrain) [a-z-]+( |$)", text)
                and "pre-trains" not in text
            ):
                argv = shlex.split(text, comments=True)
                found.append((f"{doc.name}:{n}", argv[argv.index("scaletrain") + 1 :]))
    return found


def test_every_documented_command_parses():
    """Every command the docs show is one the CLI takes: its command and flags exist, its config keys exist."""
    parser, keys = build_parser(), set(all_keys(Config))
    commands = _documented_commands()
    assert len(commands) > 40
    for where, argv in commands:
        if "--help" in argv:
            assert argv[0] in parser.commands, where
            continue
        try:
            args, rest = parser.parse_known_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: argparse refuses {shlex.join(argv)}")
        assert isinstance(args, argparse.Namespace)
        for arg in _overrides_only(parser.commands[args.command], rest):
            if arg.startswith("--") and "." in arg:
                key = arg[2:].split("=", 1)[0].replace("-", "_")
                assert key in keys or key.startswith("data.sources"), f"{where}: unknown config key {key}"


def test_ctrl_c_stops_after_the_step_saves_it_and_the_printed_command_continues(tmp_path):
    """The first hour's flow (issue 21): train, Ctrl-C, the same command again. A first Ctrl-C to a single
    process stops after the step with a committed save (exit 130, no traceback); the printed command continues
    from that step. (--nproc's Ctrl-C: tests/e2e/test_launcher_signals.py.)"""
    cmd = ["train", "--config", DEBUG, "--run.dir", "runs/c", *QUICK, "--training.steps", "5000",
           "--metrics.log_interval", "1", "--training.eval_interval", "0"]  # fmt: skip
    proc = start_cli(*cmd, cwd=tmp_path)
    metrics = tmp_path / "runs" / "c" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 3) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err
    run = tmp_path / "runs" / "c"
    (saved,) = events(run, "checkpoint_saved")
    stop = saved["step"]
    assert 3 <= stop < 5000 and (run / "checkpoints" / f"step-{stop:08d}" / "commit.json").is_file()
    assert events(run, "end")[-1]["stopped"] == "interrupted"
    line = re.search(r"to continue this run: (.*)", err).group(1)
    again = run_cli(*shlex.split(line)[1:], "--run.stop_at_step", str(stop + 1), cwd=tmp_path, check=False)
    # Continued from the saved step and stopped at stop_at_step: its exit status, not a crash after the load.
    assert again.returncode == STOPPED_EXIT_CODE and "Traceback" not in again.stderr, again.stderr
    assert starts(run) == [0, stop] and max(losses(run)) == stop + 1, losses(run)
