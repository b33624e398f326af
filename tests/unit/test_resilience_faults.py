"""Fault injection: the typed fault tables and their errors, each hook firing at its step on its rank, once per
job, attached where the failure really happens."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from scaletrain.config import FaultConfig
from scaletrain.errors import ConfigError
from scaletrain.resilience import faults
from scaletrain.resilience.faults import FaultInjector, InjectedFault, check_specs, label, validate_specs
from scaletrain.validate import load_config
from tests.fixtures import tiny

ROOT = Path(__file__).resolve().parents[2]


class Events:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def __call__(self, kind: str, **fields) -> None:
        self.calls.append((kind, fields))


def fc(kind: str, **keys) -> FaultConfig:
    return FaultConfig(kind=kind, **keys)


def _injector(tmp_path: Path, specs: list[FaultConfig], rank: int = 0) -> tuple[FaultInjector, Events]:
    ev = Events()
    return FaultInjector(specs, rank=rank, run_dir=tmp_path, event=ev), ev


def test_the_cli_reads_a_list_of_fault_tables():
    cfg = load_config(
        None,
        ["--resilience.inject", '[{kind="kill", rank=1, step=5}, {kind="slow", rank=0, factor=2.5}]'],
        world_size=2,
        check_run_dir=False,
    )
    assert cfg.resilience.inject == [fc("kill", rank=1, step=5), fc("slow", rank=0, factor=2.5)]
    assert [label(f) for f in cfg.resilience.inject] == ["kill:rank=1,step=5", "slow:rank=0,factor=2.5"]


@pytest.mark.parametrize(
    "spec, expect",
    [
        (fc("kill", rank=1), 'kill needs "step"; it takes rank, step'),
        (fc("nan", step=3, factor=2.0), 'nan does not take "factor"; it takes step[, rank]'),
        (fc("raise", rank=0, step=0), "step must be >= 1"),
        (fc("slow", rank=0, factor=1.0), "factor must be a number > 1"),
        (FaultConfig(step=3), "needs a kind"),
    ],
)
def test_bad_faults_are_named_with_the_fix(spec, expect):
    problems = validate_specs([fc("nan", step=1), spec])
    assert len(problems) == 1 and problems[0].startswith("resilience.inject[1]")
    assert expect in problems[0], problems
    with pytest.raises(ConfigError) as e:
        check_specs([fc("nan", step=1), spec])
    assert expect in str(e.value)


def test_unknown_kind_is_refused_by_the_config_walker_with_the_valid_ones():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--resilience.inject", '[{kind="explode", step=1}]'], check_run_dir=False)
    assert "kill" in str(e.value) and "write_error" in str(e.value) and "inject[0].kind" in str(e.value)
    assert validate_specs([fc("kill", rank=3, step=2)], world_size=4) == []
    assert "rank 4 does not exist" in validate_specs([fc("kill", rank=4, step=2)], world_size=4)[0]


def test_a_rank_the_world_lacks_is_refused_at_the_first_start_and_let_be_in_a_job_re_formed_smaller(
    monkeypatch,
):
    """--nnodes 1:2 after a node left: the job re-forms with 2 ranks while a fault names rank 2, of the node that may
    come back (tests/cluster/test_node_loss.py's drill); refusing it there failed the re-formed job on every retry."""
    args = ["--resilience.inject", '[{kind="hang", rank=2, step=7}]']
    with pytest.raises(ConfigError, match="rank 2 does not exist in a world of 2"):
        load_config(None, args, world_size=2, check_run_dir=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    load_config(None, args, world_size=2, check_run_dir=False)


def test_raise_fires_on_its_rank_and_step_only_once_per_job(tmp_path):
    other, ev_other = _injector(tmp_path, [fc("raise", rank=1, step=3)], rank=0)
    other.at_step_start(3)  # rank 0: not its fault
    inj, ev = _injector(tmp_path, [fc("raise", rank=1, step=3)], rank=1)
    inj.at_step_start(2)
    with pytest.raises(InjectedFault, match=r"'raise:rank=1,step=3' on rank 1 at step 3"):
        inj.at_step_start(3)
    assert ev.calls == [("fault_injected", {"step": 3, "fault": "raise:rank=1,step=3", "rank": 1})]
    assert ev_other.calls == []
    # The restarted worker (a new injector on the same run directory) replays step 3 without the fault.
    again, ev_again = _injector(tmp_path, [fc("raise", rank=1, step=3)], rank=1)
    again.at_step_start(3)
    assert ev_again.calls == []
    assert [(r["fault"], r["rank"], r["step"]) for r in again.fired()] == [("raise:rank=1,step=3", 1, 3)]


def test_hang_records_before_it_sleeps(tmp_path, monkeypatch):
    def fake_sleep():
        # By the time the rank hangs, the record that stops a restart from hanging again is on disk.
        records = json.loads((tmp_path / faults.FIRED_FILE).read_text())
        raise TimeoutError(records)

    monkeypatch.setattr(faults, "_sleep_forever", fake_sleep)
    inj, ev = _injector(tmp_path, [fc("hang", rank=0, step=4)])
    inj.at_step_start(3)
    with pytest.raises(TimeoutError) as e:
        inj.at_step_start(4)
    assert e.value.args[0][0]["fault"] == "hang:rank=0,step=4"
    assert ev.calls[0][0] == "fault_injected"


def test_kill_sigkills_the_process_after_recording(tmp_path):
    script = textwrap.dedent(f"""
        from pathlib import Path
        from scaletrain.config import FaultConfig
        from scaletrain.resilience.faults import FaultInjector
        inj = FaultInjector([FaultConfig(kind="kill", rank=0, step=2)], rank=0, run_dir=Path({str(tmp_path)!r}),
                            event=lambda kind, **f: print(kind, f, flush=True))
        for step in (1, 2, 3):
            print("step", step, flush=True)
            inj.at_step_start(step)
        print("survived", flush=True)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "step 2" in proc.stdout and "fault_injected" in proc.stdout and "survived" not in proc.stdout
    records = json.loads((tmp_path / faults.FIRED_FILE).read_text())
    assert [(r["fault"], r["rank"], r["step"]) for r in records] == [("kill:rank=0,step=2", 0, 2)]
    inj, ev = _injector(tmp_path, [fc("kill", rank=0, step=2)])
    inj.at_step_start(2)  # after the restart: no second kill (this test process would die)
    assert ev.calls == []


def _nan_logits(inj: FaultInjector, model, step: int) -> bool:
    inj.at_step_start(step)
    try:
        return bool(model(torch.randint(0, 64, (1, 8))).isnan().all())
    finally:
        inj.at_step_end(step, 0.0)


def test_nan_turns_the_output_logits_to_nan_on_every_rank_without_a_rank_key(tmp_path):
    """Attached as a forward hook on the output layer: the step's loss and every gradient turn NaN, as after an
    overflow, with nothing threaded through the training step."""
    models = [tiny() for _ in range(3)]
    injectors = [_injector(tmp_path, [fc("nan", step=3)], rank=r)[0] for r in range(3)]
    for inj, model in zip(injectors, models):
        inj.attach(None, [model])
    assert not any(_nan_logits(inj, m, 2) for inj, m in zip(injectors, models))
    assert all(_nan_logits(inj, m, 3) for inj, m in zip(injectors, models))
    assert not any(_nan_logits(inj, m, 3) for inj, m in zip(injectors, models))  # a replayed step 3 is clean
    assert sorted(r["rank"] for r in injectors[0].fired()) == [0, 1, 2]
    only1 = _injector(tmp_path / "b", [fc("nan", step=3, rank=1)], rank=0)[0]
    only1.attach(None, [models[0]])
    assert not _nan_logits(only1, models[0], 3)


def test_nan_leaves_evaluation_alone(tmp_path):
    model = tiny()
    inj, _ = _injector(tmp_path, [fc("nan", step=1)])
    inj.attach(None, [model])
    model.eval()
    assert not _nan_logits(inj, model, 1)


class _Loader:
    def __init__(self, x, y):
        self.batch = (x, y)

    def next_batch(self, sequences=None):
        return self.batch

    def state_dict(self):
        return {"next_sample": 7}


def test_spike_replaces_the_targets_with_seeded_noise(tmp_path):
    x = torch.arange(64).reshape(4, 16) % 50
    y = (x + 1) % 50
    a, _ = _injector(tmp_path / "a", [fc("spike", step=5)])
    b, ev = _injector(tmp_path / "b", [fc("spike", step=5)])
    la, lb = a.attach(_Loader(x, y), []), b.attach(_Loader(x, y), [], vocab_size=50)
    assert la.state_dict() == {"next_sample": 7}  # the wrapper is the loader in every other respect
    a.at_step_start(4)
    assert la.next_batch() == (x, y)
    a.at_step_start(5)
    b.at_step_start(5)
    (xa, ya), (_, yb) = la.next_batch(), lb.next_batch()
    assert xa is x and torch.equal(ya, yb)  # seeded: the drill is repeatable
    assert ya.shape == y.shape and ya.dtype == y.dtype and int(ya.max()) < 50
    assert (ya != y).float().mean() > 0.8
    assert ev.calls[0][1]["fault"] == "spike:step=5"
    assert lb.next_batch()[1] is y  # once


def test_slow_computes_factor_minus_one_times_the_step(tmp_path, monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(
        faults, "_spin", lambda seconds, clock: slept.append(seconds) if clock is busy else None
    )
    busy = time.process_time  # the clock busy_s was measured with: the spin must count on it
    inj, ev = _injector(tmp_path, [fc("slow", rank=0, factor=3.0, step=4)])
    assert inj.at_step_end(3, 0.5, busy) == 0.0
    assert inj.at_step_end(4, 0.5, busy) == pytest.approx(1.0)
    assert inj.at_step_end(5, 0.25, busy) == pytest.approx(0.5)  # stays slow for the rest of this process
    assert slept == pytest.approx([1.0, 0.5])
    assert [c[1]["step"] for c in ev.calls] == [4] and ev.calls[0][1]["factor"] == 3.0
    restarted, _ = _injector(tmp_path, [fc("slow", rank=0, factor=3.0, step=4)])
    assert restarted.at_step_end(6, 0.5) == 0.0  # fired once per job: not after a restart


def test_corrupt_checkpoint_flips_bytes_of_the_largest_shard_on_rank_0(tmp_path):
    ckpt = tmp_path / "checkpoints" / "step-00000006"
    ckpt.mkdir(parents=True)
    small, big = ckpt / "__1_0.distcp", ckpt / "__0_0.distcp"
    small.write_bytes(bytes(100))
    big.write_bytes(bytes(range(256)) * 8)
    (ckpt / ".metadata").write_bytes(b"m" * 5000)
    original = big.read_bytes()
    rank1, _ = _injector(tmp_path, [fc("corrupt_checkpoint", step=6)], rank=1)
    assert rank1.after_checkpoint_commit(6, ckpt) is None  # rank 0 does it by default
    inj, ev = _injector(tmp_path, [fc("corrupt_checkpoint", step=6)], rank=0)
    assert inj.after_checkpoint_commit(5, ckpt) is None
    assert inj.after_checkpoint_commit(6, ckpt) == big
    damaged = big.read_bytes()
    diff = [i for i, (a, b) in enumerate(zip(original, damaged)) if a != b]
    assert len(damaged) == len(original) and len(diff) == 64 and 900 < diff[0] < diff[-1] < 1100
    assert small.read_bytes() == bytes(100) and ev.calls[0][1]["file"] == str(big)
    assert inj.after_checkpoint_commit(6, ckpt) is None and big.read_bytes() == damaged  # once


def test_concurrent_ranks_keep_every_record(tmp_path):
    # Ranks sharing the run directory claim at the same moment: none may overwrite another's records.
    specs = [fc("nan", step=s) for s in range(1, 11)]
    injectors = [_injector(tmp_path, specs, rank=r)[0] for r in range(4)]
    start = threading.Barrier(len(injectors))

    def run(inj: FaultInjector) -> None:
        start.wait()
        for step in range(1, 11):
            inj.at_step_start(step)

    threads = [threading.Thread(target=run, args=(inj,)) for inj in injectors]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = json.loads((tmp_path / faults.FIRED_FILE).read_text())
    assert sorted((r["rank"], r["step"]) for r in records) == [(r, s) for r in range(4) for s in range(1, 11)]


def test_spin_stays_busy_for_the_time_asked_on_the_busy_clock(monkeypatch):
    # Busy, not asleep: busy-time straggler detection (CPU time) must see an injected slowdown, and the spin counts
    # on the clock the rank is measured with (CPU time on CPU: a wall-clock spin on cores shared with other
    # processes gets only part of the CPU it promised). A fake clock keeps this deterministic.
    now, calls = [100.0], []

    def clock():
        calls.append(now[0])
        now[0] += 0.01
        return now[0]

    def sleep(_seconds):
        raise AssertionError("_spin must not sleep: a sleeping rank uses no CPU time")

    monkeypatch.setattr(faults.time, "sleep", sleep)
    faults._spin(0.2, clock)
    assert now[0] - 100.0 >= 0.2 and len(calls) >= 20  # polled the given clock the whole time
