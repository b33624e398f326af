"""`make test` alone sets a fresh machine up: CI's script adds no step of its own, and every system tool a test
calls is in the preflight's table (installed or named before the first test), not left to a hand install."""

import re
import shutil
import sys
from pathlib import Path

from tests import preflight

ROOT = Path(__file__).resolve().parents[2]
# A command a test runs: a shutil.which() of it, or the first word of a list handed to subprocess.
CALLS = re.compile(r'which\("([^"]+)"\)|subprocess\.\w+\(\s*\[\s*"([^"]+)"')
BASE = {
    "sh",
    "bash",
    "git",
    "apt-get",
}  # on every machine that can clone the project; apt-get is the installer


def commands_called_by_tests() -> set[str]:
    found = set()
    for path in (ROOT / "tests").rglob("*.py"):
        if path.name not in ("preflight.py", "test_preflight.py"):
            found |= {a or b for a, b in CALLS.findall(path.read_text())}
    return found


def test_ci_runs_make_test_and_nothing_else():
    steps = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    steps = [s for s in steps if s and not s.startswith("#")]
    extra = [s for s in steps if not re.match(r"(set |cd |(exec )?make test$)", s)]
    assert "make test" in steps and not extra, f".ci/run does more than make test: {extra}"


def test_make_test_runs_the_preflight_before_the_tests():
    makefile = (ROOT / "Makefile").read_text()
    target = re.search(r"^test:(.*)$", makefile, re.M).group(1).split()
    assert "preflight" in target
    assert re.search(r"^preflight:.*\n\t.*-m tests\.preflight", makefile, re.M)


def test_every_system_tool_a_test_calls_is_in_the_preflight_table():
    venv = Path(sys.executable).parent
    known = {cmd for name, _, _ in preflight.NEEDS for cmd in preflight.ALIASES.get(name, (name,))}
    known |= BASE
    unlisted = {
        c for c in commands_called_by_tests() if c not in known and shutil.which(c, path=str(venv)) is None
    }
    assert not unlisted, f"tests call {sorted(unlisted)}: add them to tests/preflight.py's NEEDS"


def test_a_missing_tool_is_named_with_its_install_command(monkeypatch, capsys):
    monkeypatch.setattr(preflight, "NEEDS", (("no-such-tool-xyz", "xyz-pkg", "a test needs it"),))
    monkeypatch.setattr(preflight, "install", lambda packages: False)
    assert preflight.main() == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no-such-tool-xyz" in err and "apt-get install -y xyz-pkg" in err
