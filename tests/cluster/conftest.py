"""On a failed cluster test, the report carries the tail of each node's log (the `*.log` files the test wrote into
its tmp_path): a drill that failed in CI is read from CI's output, its tmp_path is gone."""

from __future__ import annotations

from pathlib import Path

import pytest

TAIL = 120  # lines of each log (a timed-out drill adds each worker's stacks)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    tmp = item.funcargs.get("tmp_path") if hasattr(item, "funcargs") else None
    if report.when != "call" or not report.failed or tmp is None:
        return
    for log in sorted(Path(tmp).glob("*.log")):
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        report.sections.append((f"{log.name}, last {TAIL} lines", "\n".join(lines[-TAIL:])))
