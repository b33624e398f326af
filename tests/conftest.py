import json
import os
import time
from pathlib import Path

import pytest

from tests.preflight import LAST_RUN

# Tests run on a 2-core machine beside other processes: one thread each unless a test says otherwise. Tokenised
# data and the measured CPU peak go to a cache inside the checkout, shared by the tests of one run and never by the
# user's ~/.cache.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("SCALETRAIN_CACHE", str(Path(__file__).resolve().parents[1] / ".cache" / "tests"))
# Plans use the built-in CPU defaults instead of probing this CPU (seconds per fresh cache, and many tests plan in a
# cache of their own); tests/unit/test_probe.py probes.
os.environ.setdefault("SCALETRAIN_PROBE", "0")


# The longest files first, so that a worker is not left with one of them while the other has finished. xdist's
# default reorders files by test count (the 150 s checkpoint chain, one test, went last in a measured run), so
# make test passes `--no-loadscope-reorder`, which keeps this order. The order of the seconds each file took in a
# whole `make test` on the 2-core Intel CI machine (sdc 201 s ... kernel_faults 40 s), the files re-measured after
# the trims of 2026-12-07 scaled by their measured change (sdc, resilience, checkpoint_cli, train_cli -8 to -15%).
SLOW_FIRST = (
    "e2e/test_sdc.py",
    "cluster/test_partition.py",
    "e2e/test_user_form.py",
    "e2e/test_resilience.py",
    "e2e/test_fault_tolerance.py",
    "e2e/test_checkpoint_cli.py",
    "cluster/test_node_loss.py",
    "e2e/test_train_cli.py",
    "e2e/test_checkpoint_layouts.py",
    "distributed/test_hybrid_layouts.py",
    "cluster/test_many_nodes.py",
    "e2e/test_parity.py",
    "e2e/test_batch_ramp.py",
    "e2e/test_hf_import_sharded.py",
    "cluster/test_agent_death.py",
    "cluster/test_slurm.py",
    "e2e/test_gpu_check_dry_run.py",
    "e2e/test_resume_rules.py",
    "distributed/test_muon.py",
    "e2e/test_streaming_cli.py",
    "e2e/test_train_loop.py",
    "e2e/test_report.py",
    "distributed/test_families.py",
    "e2e/test_kernel_faults.py",
)


def pytest_collection_modifyitems(items: list) -> None:
    def rank(item) -> int:
        path = Path(str(item.fspath)).as_posix()
        return next((i for i, name in enumerate(SLOW_FIRST) if path.endswith(name)), len(SLOW_FIRST))

    items.sort(key=rank)  # stable: the order within a file stays
    # The GPU check (benchmarks/gpu_check.sh) runs tests/gpu only: a gpu test elsewhere would never run anywhere.
    misplaced = [i.nodeid for i in items if i.get_closest_marker("gpu") and "tests/gpu/" not in i.nodeid]
    if misplaced:
        raise pytest.UsageError(
            f"marked gpu outside tests/gpu, where the GPU check never runs them: {misplaced}"
        )


def pytest_sessionstart(session) -> None:
    session.config._scaletrain_started = time.time()


# Seconds per test file (set-up, call and tear-down; under xdist the workers' reports reach the controller's hook),
# recorded with the whole run's time: the measured order SLOW_FIRST should follow.
_FILES: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    path = report.nodeid.split("::")[0]
    _FILES[path] = _FILES.get(path, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus: int) -> None:
    """A whole-suite run (`make test`, no selection) records its wall time: tests/preflight.py quotes it next time
    as what the suite takes on this machine. `--collect-only` ran no test: its seconds would read as the suite's."""
    config = session.config
    whole = [Path(a).resolve() for a in config.args] == [Path(__file__).parent] and not config.option.keyword
    whole = whole and not config.option.collectonly
    if hasattr(config, "workerinput") or not whole or exitstatus not in (0, 1) or config.option.markexpr:
        return
    LAST_RUN.parent.mkdir(parents=True, exist_ok=True)
    seconds = time.time() - config._scaletrain_started
    longest = dict(sorted(((f, round(t, 1)) for f, t in _FILES.items()), key=lambda ft: -ft[1]))
    LAST_RUN.write_text(
        json.dumps(
            {
                "seconds": round(seconds),
                "tests": session.testscollected,
                "ended": time.time(),
                "files": longest,
            },
            indent=1,
        )
    )
