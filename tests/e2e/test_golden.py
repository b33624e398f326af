"""Golden losses (torchtitan keeps tests/assets/losses): the debug job in deterministic mode must reproduce the
per-step losses, grad norms and validation losses recorded in tests/golden/debug.json. A change that should not
alter the computation leaves them bit-equal; one that does re-records them (`python -m tests.golden.record`) in
the same commit and says why."""

import json

import pytest

from tests.golden.record import GOLDEN, LAYOUTS, run_layout

GOLD = json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_debug_job_reproduces_the_golden_losses(name, tmp_path):
    got = run_layout(name, tmp_path / name)
    want = GOLD["layouts"][name]
    # Exact: the same kernels, thread count and reduction order give the same bits on CPU (two multi-process
    # recordings on the same commit were identical too, so no tolerance hides a change).
    assert got["loss"] == want["loss"], (
        f"losses moved from the golden run (recorded on {GOLD['recorded_on']})"
    )
    assert got["grad_norm"] == want["grad_norm"]
    assert got["val_loss"] == want["val_loss"]
