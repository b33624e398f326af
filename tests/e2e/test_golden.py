"""Golden losses (torchtitan keeps tests/assets/losses): the debug job in deterministic mode must reproduce the
per-step losses, grad norms and validation losses recorded in tests/golden/debug.json. A change that should not
alter the computation leaves them bit-equal; one that does re-records them (`python -m tests.golden.record`) in
the same commit and says why."""

import pytest

from tests.golden.record import LAYOUTS, golden_problem, run_layout


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_debug_job_reproduces_the_golden_losses(name, tmp_path):
    # Exact on a CPU with a recording: the same kernels, thread count and reduction order give the same bits (two
    # multi-process recordings on the same commit were identical too, so no tolerance hides a change).
    problem = golden_problem(name, run_layout(name, tmp_path / name))
    assert problem is None, problem
