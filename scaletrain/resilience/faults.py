"""Fault injection for tests and drills: `resilience.inject` tables such as {kind="kill", rank=1, step=5} make a
chosen rank fail in a chosen way at a chosen step. Each fault fires once per job, recorded in
<run_dir>/faults_fired.json. The faults are attached at setup where each failure really happens (a loader wrapper,
a forward hook on the output layer, the checkpoint's storage writer and commit callback); nothing in the training
step carries a test parameter."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain.config import FaultConfig
from scaletrain.errors import ConfigError
from scaletrain.metrics.writer import append_event
from scaletrain.models.llama import Transformer

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
    "kill_during_save": (("step",), ("rank",)),
    "bitflip": (("rank", "step"), ()),
    "compute_error": (("rank", "step"), ()),
}
_KEYS = ("rank", "step", "factor")


class InjectedFault(RuntimeError):
    """Raised by a `raise` fault: an ordinary worker exception, as a bug or a failed assertion would be."""


def label(f: FaultConfig) -> str:
    """The fault as one short string, e.g. "kill:rank=1,step=5": its name in events and in the fired record."""
    keys = [k for k in _KEYS if getattr(f, k) is not None]
    return f"{f.kind}:" + ",".join(f"{k}={_num(getattr(f, k))}" for k in keys)


def _num(v: float | int) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


def _on_rank(f: FaultConfig, rank: int) -> bool:
    # corrupt_checkpoint defaults to rank 0, so that one process flips the bytes.
    want = f.rank if f.rank is not None else (0 if f.kind == "corrupt_checkpoint" else None)
    return want is None or want == rank


def _spin(seconds: float, clock: Callable[[], float] = time.perf_counter) -> None:
    """Keep the CPU busy for `seconds` on `clock`: the clock the rank's busy time is measured with (CPU time on
    CPU, so the slowed rank's work grows by the factor however many processes share the cores; a wall-clock spin
    on an oversubscribed machine got half the CPU it promised and the slowdown fell below the detection factor)."""
    deadline = clock() + seconds
    while clock() < deadline:
        pass


def _keys(kind: str) -> str:
    required, optional = KINDS[kind]
    return ", ".join(required) + "".join(f"[, {k}]" for k in optional)


def _kinds_help() -> str:
    return "valid kinds (keys): " + "; ".join(f"{kind} ({_keys(kind)})" for kind in KINDS)


def _problems(i: int, f: FaultConfig, world_size: int | None) -> list[str]:
    where = f"resilience.inject[{i}]"
    if f.kind is None:
        return [f'{where} needs a kind, e.g. {{kind="kill", rank=1, step=5}}; {_kinds_help()}']
    required, optional = KINDS[f.kind]
    problems = [
        f'{where}: {f.kind} needs "{k}"; it takes {_keys(f.kind)}' for k in required if getattr(f, k) is None
    ]
    problems += [
        f'{where}: {f.kind} does not take "{k}"; it takes {_keys(f.kind)}'
        for k in _KEYS
        if k not in required + optional and getattr(f, k) is not None
    ]
    if f.rank is not None and f.rank < 0:
        problems.append(f"{where}: rank must be >= 0, got {f.rank}")
    if f.step is not None and f.step < 1:
        problems.append(f"{where}: step must be >= 1, got {f.step}")
    if f.factor is not None and not (math.isfinite(f.factor) and f.factor > 1):
        problems.append(
            f"{where}: factor must be a number > 1 (3 makes each step take 3x as long), got {f.factor}"
        )
    if world_size is not None and f.rank is not None and f.rank >= world_size:
        problems.append(
            f"{where} ({label(f)}): rank {f.rank} does not exist in a world of {world_size} process(es); "
            "it would never fire"
        )
    return problems


def validate_specs(specs: list[FaultConfig], world_size: int | None = None) -> list[str]:
    """Every problem with the faults (empty when all are valid); with `world_size`, also ranks that do not exist."""
    return [p for i, f in enumerate(specs) for p in _problems(i, f, world_size)]


def check_specs(specs: list[FaultConfig]) -> list[FaultConfig]:
    """The faults, or a `ConfigError` listing every bad one with the valid kinds and keys."""
    problems = validate_specs(specs)
    if problems:
        raise ConfigError(problems)
    return list(specs)


def _sleep_forever() -> None:
    """What a `hang:` fault runs: a rank stuck as if in a collective whose peer never arrives."""
    while True:
        time.sleep(3600)


class FaultInjector:
    """Fires the configured faults of this rank, each where that failure really happens.

    `attach` hooks them into the loader, the model and the checkpoint manager; the guard calls `at_step_start` and
    `at_step_end` (which it calls anyway for the watchdog). A fault is recorded in <run_dir>/faults_fired.json before
    it acts, so the restarted job (same run directory) does not fire it again: a kill at step 5 is a drill of one
    failure, not a crash loop. `event` is called as `event("fault_injected", step=..., fault=label, rank=...)`.
    """

    def __init__(
        self, specs: list[FaultConfig], rank: int, run_dir: Path, event: Callable[..., None] | None = None
    ) -> None:
        self.specs = [s for s in check_specs(specs) if _on_rank(s, rank)]
        self.rank = rank
        self.run_dir = Path(run_dir)
        # Ranks other than 0 have no metrics writer: their events are appended to events.jsonl directly.
        self.event = event or functools.partial(append_event, self.run_dir)
        self.vocab_size = 0
        self.parts: list[nn.Module] = []  # the model parts (attach): what a bitflip corrupts
        self.step = 0  # the step running now (set by at_step_start)
        self._nan = False  # the output layer's hook turns this step's logits to NaN
        self._compute_error = False  # the final norm's hook computes one activation of this step wrong
        # slow fault -> whether this process slows, decided at its first due step (False: an earlier run fired it).
        self._slowing: dict[str, bool] = {}

    @classmethod
    def for_job(
        cls,
        specs: list[FaultConfig],
        rank: int,
        run_dir: Path,
        event: Callable[..., None] | None,
        loader: Any,
        parts: list[nn.Module],
        ckpt: Any,
        vocab_size: int,
    ) -> tuple[FaultInjector | None, Any]:
        """The injector of resilience.inject attached at setup (attach), and the loader to train from; without
        faults: (None, the loader as it is)."""
        if not specs:
            return None, loader
        faults = cls(specs, rank, run_dir, event)
        return faults, faults.attach(loader, parts, ckpt, vocab_size=vocab_size)

    def _due(self, kinds: tuple[str, ...], step: int) -> list[FaultConfig]:
        return [s for s in self.specs if s.kind in kinds and s.step == step]

    def attach(self, loader: Any, parts: list[nn.Module], ckpt: Any = None, vocab_size: int = 0) -> Any:
        """Hook the faults into the model parts and (when given) the checkpoint manager; returns the loader to train
        from (wrapped when a spike is configured)."""
        self.vocab_size = vocab_size
        self.parts = parts
        for part in parts:
            for m in part.modules():
                if (
                    isinstance(m, Transformer) and m.output is not None
                ):  # the last pipeline stage's output layer
                    m.output.register_forward_hook(self._nan_hook)
                    if m.norm is not None:
                        m.norm.register_forward_hook(self._compute_error_hook)
        if ckpt is not None:
            ckpt.make_writer = self.wrap_writer(ckpt.make_writer)
            ckpt.on_commit.append(self.after_checkpoint_commit)
        return _SpikeLoader(loader, self) if any(s.kind == "spike" for s in self.specs) else loader

    # -- hooks, in the order a step meets them ------------------------------------------------------------------

    def at_step_start(self, step: int) -> None:
        """kill (SIGKILL itself), raise (`InjectedFault`) or hang (sleep until the watchdog ends the process); arms
        a nan fault for this step's forward passes."""
        self.step = step
        for spec in self._due(("kill", "raise", "hang"), step):
            if not self._claim(spec, step):
                continue
            self._fired(spec, step)
            if spec.kind == "kill":
                # SIGKILL, not sys.exit: no handler, no atexit, no flush: what an OOM kill or a lost node looks like.
                os.kill(os.getpid(), signal.SIGKILL)
            elif spec.kind == "raise":
                raise InjectedFault(f"injected fault {label(spec)!r} on rank {self.rank} at step {step}")
            else:
                log.warning(
                    "injected hang %r: rank %d sleeps at the start of step %d", label(spec), self.rank, step
                )
                _sleep_forever()
        due = self._due(("nan",), step)
        self._nan = bool(due) and self._claim(due[0], step)
        if self._nan:
            self._fired(due[0], step)
        due = self._due(("compute_error",), step)
        self._compute_error = bool(due) and self._claim(due[0], step)
        if self._compute_error:
            self._fired(due[0], step)

    def corrupt_batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """spike: replace the targets with random tokens, so the loss jumps as on a batch of garbage data.

        The tokens come from a generator seeded by the step, so a drill is repeatable. Without a vocabulary size
        they are drawn below the largest token id in the batch (plus one).
        """
        due = self._due(("spike",), self.step)
        if not due or not self._claim(due[0], self.step):
            return inputs, targets
        high = self.vocab_size or int(max(inputs.max().item(), targets.max().item())) + 1
        gen = torch.Generator().manual_seed(0x5EED + self.step)
        noise = torch.randint(0, high, targets.shape, generator=gen, dtype=targets.dtype)
        self._fired(due[0], self.step)
        return inputs, noise.to(targets.device)

    def _nan_hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        """nan: NaN logits in training forwards of the armed step, so the loss and every gradient turn NaN as after
        an overflow (evaluation, in eval mode, is left alone)."""
        return output * math.nan if self._nan and module.training else None

    def _compute_error_hook(
        self, module: nn.Module, args: tuple, output: torch.Tensor
    ) -> torch.Tensor | None:
        """compute_error: in the armed step's first training forward, one activation (the final norm's output, the
        middle element) comes out 2^16 times too large, as after a flipped exponent bit in an ALU: a transient
        fault of this rank's computation, its weights untouched (a replay computes it right)."""
        if not (self._compute_error and module.training):
            return None
        self._compute_error = False
        wrong = output.detach().clone()
        wrong.view(-1)[wrong.numel() // 2] *= 2.0**16
        return output + (wrong - output.detach())

    def at_step_end(self, step: int, busy_s: float, clock: Callable[[], float] = time.perf_counter) -> float:
        """slow: compute for another (factor - 1) x this step's busy time, as a processor `factor` times slower would
        (busy: it uses the CPU, unlike a sleep, so busy-time straggler detection sees it); returns the seconds
        added, on `clock` (the one busy_s was measured with). A slow rank stays slow for the rest of this process."""
        self._nan = self._compute_error = False
        slept = 0.0
        for spec in self.specs:
            if spec.kind != "slow" or step < (spec.step or 1):
                continue
            name = label(spec)
            if name not in self._slowing:
                self._slowing[name] = self._claim(spec, step)
                if self._slowing[name]:
                    self._fired(spec, step, factor=spec.factor)
            if self._slowing[name]:
                extra = (spec.factor - 1.0) * max(busy_s, 0.0)
                _spin(extra, clock)
                slept += extra
        return slept

    def after_update(self, step: int) -> str | None:
        """bitflip: right after this step's optimizer update, flip one low mantissa bit (a small, finite change: no
        NaN guard sees it) of the middle element of this rank's largest local parameter slice, as a faulty device
        would. Returns the parameter's name."""
        due = self._due(("bitflip",), step)
        if not due or not self._claim(due[0], step):
            return None
        named = [(n, _local(p)) for part in self.parts for n, p in part.named_parameters()]
        name, local = max(named, key=lambda np: np[1].numel())  # the first of the largest
        bit = 10 if local.element_size() >= 4 else 2  # fp32: a change of ~1e-4 relative; bf16/fp16: ~3%
        ints = local.detach().view(-1).view({4: torch.int32, 2: torch.int16}[local.element_size()])
        with torch.no_grad():
            ints[ints.numel() // 2 : ints.numel() // 2 + 1].bitwise_xor_(1 << bit)
        self._fired(due[0], step, param=name, bit=bit)
        return name

    def wrap_writer(self, make: Callable[[str, int], Any]) -> Callable[[str, int], Any]:
        """write_error / kill_during_save: the storage writer DCP uses for the save of that step fails inside its
        write_data (with OSError ENOSPC, as on a full disk, or a SIGKILL mid-write), so DCP reports it as it would
        a real one (a CheckpointException on every rank)."""

        def make_writer(path: str, step: int) -> Any:
            writer = make(path, step)
            due = self._due(("write_error", "kill_during_save"), step)
            if due:
                write = writer.write_data

                def write_data(plan: Any, planner: Any) -> Any:
                    if not self._claim(due[0], step):
                        return write(plan, planner)
                    self._fired(due[0], step)
                    if due[0].kind == "kill_during_save":
                        os.kill(os.getpid(), signal.SIGKILL)
                    raise OSError(errno.ENOSPC, f"No space left on device (injected fault {label(due[0])!r})")

                writer.write_data = write_data
            return writer

        return make_writer

    def after_checkpoint_commit(self, step: int, ckpt_dir: Path | str) -> Path | None:
        """corrupt_checkpoint: once the checkpoint of `step` is committed, flip bytes in the middle of its largest
        shard file (local paths only), so that loading must notice the checksum mismatch. Returns the file."""
        due = self._due(("corrupt_checkpoint",), step)
        if not due:
            return None
        target = _largest_shard(Path(ckpt_dir))
        if target is None:
            log.warning("injected fault %r: no shard file in %s to corrupt", label(due[0]), ckpt_dir)
            return None
        if not self._claim(due[0], step):
            return None
        _flip_middle(target)
        self._fired(due[0], step, file=str(target))
        return target

    # -- once per job ------------------------------------------------------------------------------------------

    def _fired(self, spec: FaultConfig, step: int, **extra: object) -> None:
        log.warning("injected fault %r fires on rank %d at step %d", label(spec), self.rank, step)
        self.event("fault_injected", step=step, fault=label(spec), rank=self.rank, **extra)

    def _claim(self, spec: FaultConfig, step: int) -> bool:
        """Record that `spec` fires on this rank, unless an earlier process of this job already did: True to fire.

        Ranks of one node share the file: an exclusive lock serialises their read-modify-write, and the new content
        is written aside and renamed in, so a kill at any moment leaves the old or the new record, never half."""
        path = self.run_dir / FIRED_FILE
        with _locked(self.run_dir / (FIRED_FILE + ".lock")):
            records = _read_records(path)
            if any(r.get("fault") == label(spec) and r.get("rank") == self.rank for r in records):
                return False
            records.append({"fault": label(spec), "rank": self.rank, "step": step, "time": time.time()})
            tmp = path.with_name(f"{FIRED_FILE}.tmp.{os.getpid()}.{self.rank}")
            tmp.write_text(json.dumps(records, indent=1))
            os.replace(tmp, path)
        return True

    def fired(self) -> list[dict]:
        """The records of every fault fired so far in this job, on any rank."""
        return _read_records(self.run_dir / FIRED_FILE)


class _SpikeLoader:
    """The training loader with spike faults applied to its batches; everything else is the loader's own."""

    def __init__(self, loader: Any, injector: FaultInjector) -> None:
        self._loader, self._injector = loader, injector

    def next_batch(self, sequences: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._injector.corrupt_batch(*self._loader.next_batch(sequences))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


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


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


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
