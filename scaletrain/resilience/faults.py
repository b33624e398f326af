"""Fault injection for tests and drills: `resilience.inject` specs such as "kill:rank=1,step=5" make a chosen rank
fail in a chosen way at a chosen step. Each fault fires once per job, recorded in <run_dir>/faults_fired.json."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from scaletrain.errors import ConfigError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("scaletrain")

FIRED_FILE = "faults_fired.json"

# kind -> (required keys, optional keys). The order here is the order the error message lists them in.
KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "kill": (("rank", "step"), ()),
    "raise": (("rank", "step"), ()),
    "hang": (("rank", "step"), ()),
    "nan": (("step",), ("rank",)),
    "spike": (("step",), ("rank",)),
    "slow": (("rank", "factor"), ("step",)),
    "corrupt_checkpoint": (("step",), ("rank",)),
    "write_error": (("step",), ("rank",)),
}


class InjectedFault(RuntimeError):
    """Raised by a `raise:` fault: an ordinary worker exception, as a bug or a failed assertion would be."""


@dataclass(frozen=True)
class FaultSpec:
    """One parsed `kind:key=value,...` spec; `text` is the spec as written (the key it is recorded under)."""

    text: str
    kind: str
    rank: int | None = None
    """None: every rank (corrupt_checkpoint: rank 0, so that one process flips the bytes)."""
    step: int | None = None
    """The step it fires at; for slow, the first step it slows (None: from the first)."""
    factor: float | None = None

    def on_rank(self, rank: int) -> bool:
        default = 0 if self.kind == "corrupt_checkpoint" else None
        want = self.rank if self.rank is not None else default
        return want is None or want == rank


def _spin(seconds: float) -> None:
    """Keep the CPU busy for `seconds` of wall time."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def _keys(kind: str) -> str:
    required, optional = KINDS[kind]
    return ", ".join(required) + "".join(f"[, {k}]" for k in optional)


def _kinds_help() -> str:
    return "valid kinds (keys): " + "; ".join(f"{kind} ({_keys(kind)})" for kind in KINDS)


def _parse(text: str) -> tuple[FaultSpec | None, list[str]]:
    where = f'resilience.inject "{text}"'
    kind, sep, rest = text.strip().partition(":")
    if not sep or kind not in KINDS:
        why = "expected kind:key=value,..." if not sep else f'unknown kind "{kind}"'
        return None, [f"{where}: {why}; {_kinds_help()}"]
    required, optional = KINDS[kind]
    values: dict[str, str] = {}
    problems: list[str] = []
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not value:
            problems.append(f'{where}: "{item}" is not key=value')
        elif key not in required + optional:
            problems.append(f'{where}: unknown key "{key}" for {kind}; it takes {_keys(kind)}')
        elif key in values:
            problems.append(f'{where}: "{key}" is given twice')
        else:
            values[key] = value
    problems += [f'{where}: {kind} needs "{k}"; it takes {_keys(kind)}' for k in required if k not in values]
    parsed: dict[str, int | float] = {}
    for key, value in values.items():
        try:
            parsed[key] = float(value) if key == "factor" else int(value)
        except ValueError:
            problems.append(
                f'{where}: {key} must be {"a number" if key == "factor" else "an integer"}, got "{value}"'
            )
            continue
        low = {"rank": 0, "step": 1}.get(key)
        if low is not None and parsed[key] < low:
            problems.append(f"{where}: {key} must be >= {low}, got {value}")
        if key == "factor" and not (math.isfinite(parsed[key]) and parsed[key] > 1):
            problems.append(
                f"{where}: factor must be a number > 1 (3 makes each step take 3x as long), got {value}"
            )
    if problems:
        return None, problems
    spec = FaultSpec(
        text=text.strip(),
        kind=kind,
        rank=_opt_int(parsed.get("rank")),
        step=_opt_int(parsed.get("step")),
        factor=parsed.get("factor"),
    )
    return spec, []


def _opt_int(v: int | float | None) -> int | None:
    return None if v is None else int(v)


def validate_specs(specs: list[str], world_size: int | None = None) -> list[str]:
    """Every problem with the specs (empty when all parse); with `world_size`, also ranks that do not exist."""
    problems: list[str] = []
    for text in specs:
        spec, errs = _parse(text)
        problems += errs
        if spec is not None and world_size is not None and spec.rank is not None and spec.rank >= world_size:
            problems.append(
                f'resilience.inject "{text}": rank {spec.rank} does not exist in a world of '
                f"{world_size} process(es); it would never fire"
            )
    return problems


def parse_specs(specs: list[str]) -> list[FaultSpec]:
    """Parse the specs or raise a `ConfigError` listing every bad one with the valid kinds and keys."""
    problems = validate_specs(specs)
    if problems:
        raise ConfigError(problems)
    return [spec for spec, _ in map(_parse, specs) if spec is not None]


def _sleep_forever() -> None:
    """What a `hang:` fault runs: a rank stuck as if in a collective whose peer never arrives."""
    while True:
        time.sleep(3600)


class FaultInjector:
    """Fires the configured faults of this rank from hooks the train loop calls at fixed points of a step.

    A fault is recorded in <run_dir>/faults_fired.json before it acts, so the restarted job (same run directory)
    does not fire it again: a kill at step 5 is a drill of one failure, not a crash loop. `event` is called as
    `event("fault_injected", step=..., fault=spec, rank=...)` when a fault fires.
    """

    def __init__(self, specs: list[str], rank: int, run_dir: Path, event: Callable[..., None]) -> None:
        self.specs = [s for s in parse_specs(specs) if s.on_rank(rank)]
        self.rank = rank
        self.run_dir = Path(run_dir)
        self.event = event
        # slow spec -> whether this process slows, decided at its first due step (False: an earlier run fired it).
        self._slowing: dict[str, bool] = {}

    def _due(self, kinds: tuple[str, ...], step: int) -> list[FaultSpec]:
        return [s for s in self.specs if s.kind in kinds and s.step == step]

    # -- hooks, in the order a step meets them ------------------------------------------------------------------

    def at_step_start(self, step: int) -> None:
        """kill (SIGKILL itself), raise (`InjectedFault`) or hang (sleep until the watchdog ends the process)."""
        for spec in self._due(("kill", "raise", "hang"), step):
            if not self._claim(spec, step):
                continue
            self._fired(spec, step)
            if spec.kind == "kill":
                # SIGKILL, not sys.exit: no handler, no atexit, no flush: what an OOM kill or a lost node looks like.
                os.kill(os.getpid(), signal.SIGKILL)
            elif spec.kind == "raise":
                raise InjectedFault(f"injected fault {spec.text!r} on rank {self.rank} at step {step}")
            else:
                log.warning(
                    "injected hang %r: rank %d sleeps at the start of step %d", spec.text, self.rank, step
                )
                _sleep_forever()

    def corrupt_batch(
        self, step: int, inputs: torch.Tensor, targets: torch.Tensor, vocab_size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """spike: replace the targets with random tokens, so the loss jumps as on a batch of garbage data.

        The tokens come from a generator seeded by the step, so a drill is repeatable. Without `vocab_size` they are
        drawn below the largest token id in the batch (plus one).
        """
        due = self._due(("spike",), step)
        if not due or not self._claim(due[0], step):
            return inputs, targets
        import torch

        high = vocab_size or int(max(inputs.max().item(), targets.max().item())) + 1
        gen = torch.Generator().manual_seed(0x5EED + step)
        noise = torch.randint(0, high, targets.shape, generator=gen, dtype=targets.dtype)
        self._fired(due[0], step)
        return inputs, noise.to(targets.device)

    def loss_factor(self, step: int) -> float | None:
        """nan: float('nan') to multiply this step's loss by (before backward, so the gradients turn NaN as after
        an overflow); None when no fault is due."""
        due = self._due(("nan",), step)
        if not due or not self._claim(due[0], step):
            return None
        self._fired(due[0], step)
        return math.nan

    def at_step_end(self, step: int, busy_s: float) -> float:
        """slow: compute for another (factor - 1) x this step's busy time, as a processor `factor` times slower would
        (busy: it uses the CPU, unlike a sleep, so busy-time straggler detection sees it); returns the seconds
        added. A slow rank stays slow for the rest of this process."""
        slept = 0.0
        for spec in self.specs:
            if spec.kind != "slow" or step < (spec.step or 1):
                continue
            if spec.text not in self._slowing:
                self._slowing[spec.text] = self._claim(spec, step)
                if self._slowing[spec.text]:
                    self._fired(spec, step, factor=spec.factor)
            if self._slowing[spec.text]:
                extra = (spec.factor - 1.0) * max(busy_s, 0.0)
                _spin(extra)
                slept += extra
        return slept

    def before_checkpoint_save(self, step: int) -> None:
        """write_error: the save of this step fails with OSError(ENOSPC), as on a full disk."""
        for spec in self._due(("write_error",), step):
            if self._claim(spec, step):
                self._fired(spec, step)
                raise OSError(errno.ENOSPC, f"No space left on device (injected fault {spec.text!r})")

    def after_checkpoint_commit(self, step: int, ckpt_dir: Path | str) -> Path | None:
        """corrupt_checkpoint: once the checkpoint of `step` is committed, flip bytes in the middle of its largest
        shard file (local paths only), so that loading must notice the checksum mismatch. Returns the file."""
        due = self._due(("corrupt_checkpoint",), step)
        if not due:
            return None
        target = _largest_shard(Path(ckpt_dir))
        if target is None:
            log.warning("injected fault %r: no shard file in %s to corrupt", due[0].text, ckpt_dir)
            return None
        if not self._claim(due[0], step):
            return None
        _flip_middle(target)
        self._fired(due[0], step, file=str(target))
        return target

    # -- once per job ------------------------------------------------------------------------------------------

    def _fired(self, spec: FaultSpec, step: int, **extra: object) -> None:
        log.warning("injected fault %r fires on rank %d at step %d", spec.text, self.rank, step)
        self.event("fault_injected", step=step, fault=spec.text, rank=self.rank, **extra)

    def _claim(self, spec: FaultSpec, step: int) -> bool:
        """Record that `spec` fires on this rank, unless an earlier process of this job already did: True to fire.

        Ranks of one node share the file: an exclusive lock serialises their read-modify-write, and the new content
        is written aside and renamed in, so a kill at any moment leaves the old or the new record, never half."""
        path = self.run_dir / FIRED_FILE
        with _locked(self.run_dir / (FIRED_FILE + ".lock")):
            records = _read_records(path)
            if any(r.get("fault") == spec.text and r.get("rank") == self.rank for r in records):
                return False
            records.append({"fault": spec.text, "rank": self.rank, "step": step, "time": time.time()})
            tmp = path.with_name(f"{FIRED_FILE}.tmp.{os.getpid()}.{self.rank}")
            tmp.write_text(json.dumps(records, indent=1))
            os.replace(tmp, path)
        return True

    def fired(self) -> list[dict]:
        """The records of every fault fired so far in this job, on any rank."""
        return _read_records(self.run_dir / FIRED_FILE)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read_records(path: Path) -> list[dict]:
    try:
        records = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    return records if isinstance(records, list) else []


def _largest_shard(ckpt_dir: Path) -> Path | None:
    """The file holding most of the tensors: DCP's *.distcp shards first, else any file but the commit marker and
    the metadata (a flipped byte there fails loudly anyway; a flipped weight byte is the silent case to catch)."""
    files = [p for p in ckpt_dir.rglob("*") if p.is_file()]
    shards = [p for p in files if p.suffix == ".distcp"] or [
        p for p in files if p.name not in ("commit.json", ".metadata") and not p.name.endswith(".tmp")
    ]
    return max(sorted(shards), key=lambda p: p.stat().st_size, default=None)


def _flip_middle(path: Path, n: int = 64) -> None:
    """Invert up to n bytes around the middle of the file in place: same size, different checksum."""
    size = path.stat().st_size
    n = min(n, size)
    start = (size - n) // 2
    with open(path, "r+b") as f:
        f.seek(start)
        data = f.read(n)
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in data))
