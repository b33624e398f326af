"""[fault_tolerance] (issue 26): off by default and inert; refused before launch, with the reason, where torchft is
missing or a layout is one the replica groups have not been tested with."""

from __future__ import annotations

import pytest

from scaletrain.errors import ConfigError
from scaletrain.resilience import fault_tolerance
from scaletrain.validate import load_config
from tests.helpers import DEBUG

ON = ["--fault_tolerance.enabled", "true", "--training.eval_interval", "0", "--resilience.max_restarts", "1"]


def _problems(world_size: int, *overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(DEBUG, [*ON, *overrides], world_size=world_size, check_run_dir=False)
    return e.value.problems


def test_off_by_default_and_a_valid_layout_loads():
    assert not load_config(DEBUG, [], check_run_dir=False).fault_tolerance.enabled
    for world, extra in ((2, []), (4, ["--parallel.data_parallel", "fsdp", "--training.micro_batch", "2"])):
        if fault_tolerance.torchft_installed():
            load_config(DEBUG, [*ON, *extra], world_size=world, check_run_dir=False)


def test_without_torchft_it_is_refused_with_how_to_install(monkeypatch):
    monkeypatch.setattr(fault_tolerance, "torchft_installed", lambda: False)
    [problem] = _problems(2)
    assert "torchft" in problem and "pip install 'scaletrain[ft]'" in problem


@pytest.mark.skipif(not fault_tolerance.torchft_installed(), reason="torchft not installed")
@pytest.mark.parametrize(
    ("world", "overrides", "words"),
    [
        (3, [], "must divide --nproc"),
        (2, ["--fault_tolerance.replica_groups", "1"], "no peer to heal from"),
        (2, ["--fault_tolerance.min_replicas", "3"], "min_replicas"),
        (4, ["--parallel.tp", "2"], "tp, pp, cp, ep"),
        (4, ["--parallel.data_parallel", "zero1"], "only ddp and fsdp"),
        (2, ["--training.eval_interval", "5"], "its share of the held-out data"),
        (2, ["--precision.compute", "fp16"], "loss scaler"),
        (2, ["--resilience.spike_zscore", "3"], "only group 0 has"),
        (2, ["--fault_tolerance.group", "2"], "fault_tolerance.group must be in 0..1"),
        (2, ["--fault_tolerance.group", "1"], "give fault_tolerance.lighthouse"),
        (2, ["--fault_tolerance.address", "no-such-host.invalid"], "does not resolve"),
    ],
)
def test_combinations_it_cannot_serve_are_refused_with_the_reason(world, overrides, words):
    problems = _problems(world, *overrides)
    assert any(words in p for p in problems), problems


@pytest.mark.skipif(not fault_tolerance.torchft_installed(), reason="torchft not installed")
def test_without_a_restart_budget_it_is_refused_with_the_reason():
    """Issue 34: with resilience.max_restarts 0 (the default) a group that loses a rank never comes back, and the
    others wait FINAL_WAIT_S for it at the last step, then the job exits 1: refused before launch, saying so."""
    with pytest.raises(ConfigError) as e:
        load_config(DEBUG, [*ON[:-2]], world_size=2, check_run_dir=False)
    [problem] = e.value.problems
    assert (
        "resilience.max_restarts 0" in problem
        and "never rejoins" in problem
        and "--max-restarts N" in problem
    )
    load_config(DEBUG, ON, world_size=2, check_run_dir=False)  # with one restart: accepted
