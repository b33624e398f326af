"""Silent data corruption (issue 25 part 2): every resilience.sdc_interval steps each rank fingerprints the parameter
slices it holds (an exact int64 sum of the float bits), checks them against its own fingerprint taken right after
the update (corruption at rest) and against every rank that holds the same slice (replicas must be bit-identical).
A slice no other rank holds (fsdp, zero2, one process) is also watched at rest at every step: fingerprinted after
each update and again before the next, on the device, the differences read at the next check. The guard asks;
restoring the newest snapshot is the checkpoint manager's. docs/resilience.md, "Silent data corruption", says what
each data-parallel mode detects and what it cannot."""

from __future__ import annotations

import json
import logging
import os
import socket
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from scaletrain.config import CheckpointConfig, Config, ResilienceConfig
from scaletrain.models.llama import Transformer

log = logging.getLogger("scaletrain")

EXCLUDED_FILE = "excluded_hosts.json"  # <run_dir>/excluded_hosts.json: hosts an SDC finding marked bad

_BITS = {4: torch.int32, 2: torch.int16, 8: torch.int64, 1: torch.int8}


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """The exact fingerprint of a tensor: the sum of its elements' bit patterns as integers, in int64 (a 0-d tensor
    on the tensor's device). One flipped bit moves it by a power of two, so any single flip is seen; it reads the
    tensor once and writes nothing of its size."""
    t = t.detach()
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    return t.contiguous().view(_BITS[t.element_size()]).sum(dtype=torch.int64)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _to(tree, device):
    """The tensors of a call's arguments (a tuple or a dict of tensors and others) on `device`."""
    if isinstance(tree, dict):
        return {k: _to(v, device) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(_to(v, device) for v in tree)
    return tree.to(device) if isinstance(tree, torch.Tensor) else tree


def _slice_key(name: str, p: torch.Tensor) -> str:
    """Which slice of which parameter this rank holds: ranks with the same key must hold the same bits (DDP and
    zero1: every data-parallel rank holds the whole tensor; HSDP: the same shard index across dp_replicate)."""
    if not isinstance(p, DTensor):
        return f"{name}@{tuple(p.shape)}"
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return f"{name}@{tuple(shape)}+{tuple(offset)}"


@dataclass
class Finding:
    """What a check found: the ranks it names, each with the parameters that differ, and how it knows."""

    step: int
    params: dict[int, list[str]]  # rank -> parameter names
    how: dict[int, str]  # rank -> "at_rest" (changed since its own update), "replica" (the minority among its
    # replicas) or "replay" (its own computation, replayed from the snapshot on the same inputs, gave other bits)
    hosts: dict[int, str]
    attributed: bool = True  # False: two replicas disagree and nothing (yet) says which one is wrong
    where: str = ""  # "after_update" or "loss_spike": where in the step it was found

    @property
    def rank(self) -> int:
        return min(self.params)

    def event_fields(self) -> dict:
        return dict(
            rank=self.rank,
            ranks=sorted(self.params),
            params={str(r): names for r, names in sorted(self.params.items())},
            how={str(r): h for r, h in sorted(self.how.items())},
            hosts=sorted({self.hosts[r] for r in self.params}),
            attributed=self.attributed,
            where=self.where,
        )


@dataclass
class Report:
    """One rank's fingerprints per slice key, at its last update (recorded) and now (current); during a replay, the
    first replayed step whose logits differed from the original's (None: all equal so far)."""

    rank: int
    host: str
    keys: list[str]
    recorded: list[int]
    current: list[int]
    names: list[str] = field(default_factory=list)
    diverged: int | None = None
    # the watched slices that changed at rest since the last check
    drifted: list[str] = field(default_factory=list)


def attribute(step: int, reports: list[Report]) -> Finding | None:
    """Compare the ranks' reports: a rank whose slice changed since its own update is named (at rest); ranks that
    hold the same slice but recorded different bits are compared by majority, the minority named; a tie (two
    replicas) names every holder, unattributed. None when everything agrees."""
    params: dict[int, set[str]] = {}
    how: dict[int, str] = {}
    holders: dict[str, list[tuple[int, int, str]]] = {}
    for r in reports:
        for key, name, rec, cur in zip(r.keys, r.names, r.recorded, r.current, strict=True):
            if rec != cur or name in r.drifted:
                params.setdefault(r.rank, set()).add(name)
                how[r.rank] = "at_rest"
            holders.setdefault(key, []).append((r.rank, rec, name))
    attributed = True
    for held in holders.values():
        values = Counter(v for _, v, _ in held)
        if len(values) < 2:
            continue
        value, count = values.most_common(1)[0]
        majority = value if 2 * count > len(held) else None
        if majority is None and any(rank in how for rank, _, _ in held):
            continue  # the at-rest change explains the disagreement: that rank is named already
        attributed &= majority is not None
        for rank, v, name in held:
            if majority is None or v != majority:
                params.setdefault(rank, set()).add(name)
                how.setdefault(rank, "replica")
    if not params:
        return None
    hosts = {r.rank: r.host for r in reports}
    return Finding(step, {r: sorted(n) for r, n in params.items()}, how, hosts, attributed)


def attribute_by_replay(suspect: Finding, reports: list[Report]) -> Finding:
    """Replay verdict on an unattributed finding: of the suspects, the ranks whose logits were the first to differ
    between the original steps and their replay (same weights from the snapshot, same batches: a healthy rank
    reproduces its own bits) are named. A rank's logits depend on its own weights and its batch before any gradient
    is averaged, so the one that computed with corrupted weights diverges first; in HSDP its shard group peers
    diverge with it, which is why only the suspects (holders of the differing slice) are named. Every suspect
    diverging at the same first step tells them apart no better than the finding did: on a GPU without
    training.deterministic the replay's first update can already differ on every rank (non-deterministic kernels, then
    averaged gradients), so a healthy replica diverges too; the finding then stays unattributed."""
    first = min((r.diverged for r in reports if r.diverged is not None), default=None)
    diverged = {r.rank for r in reports if first is not None and r.diverged == first}
    named = {r: n for r, n in suspect.params.items() if r in diverged}
    if not named or named.keys() == suspect.params.keys():
        return suspect  # nothing in the replay differed, or every suspect did at once: still unattributed
    return Finding(suspect.step, named, {r: "replay" for r in named}, suspect.hosts, True, suspect.where)


@dataclass
class BuddyReport:
    """One rank's part of a replay on another rank: the fingerprint of its logits of the step as first computed,
    as it computed them again, and of its left neighbour's batches as it computed them (None: no output layer)."""

    rank: int
    host: str
    original: int | None
    own: int | None
    of_left: int | None


def attribute_by_buddy(step: int, reports: list[BuddyReport]) -> Finding | None:
    """Who computed the step's forward wrong, from each rank's logits fingerprints (`BuddyReport`): rank r's batches
    were computed a second time by r itself and by its right neighbour (its buddy), on the same weights.

    - All three equal: r's forward was right (a spike then is the data's).
    - r's first computation differs from a replay: a transient fault on r (`replay`).
    - r reproduces itself but not its buddy: one of the two devices is consistently wrong. With three or more
      ranks the buddy's own batches settle it: a buddy that agrees with its own buddy is right, and r is named
      (`buddy`); otherwise both are suspects, unattributed."""
    n = len(reports)
    named: dict[int, str] = {}
    pairs: list[set[int]] = []
    for i, r in enumerate(reports):
        b, bb = reports[(i + 1) % n], reports[(i + 2) % n]
        if r.original is None or b.of_left is None or r.original == r.own == b.of_left:
            continue
        if r.original != r.own or r.own == b.of_left:
            named[r.rank] = "replay"
        elif n >= 3 and b.original == b.own == bb.of_left:
            named[r.rank] = "buddy"
        else:
            pairs.append({r.rank, b.rank})
    suspects = {x for pair in pairs if not pair & set(named) for x in pair}
    if not named and not suspects:
        return None
    hosts = {r.rank: r.host for r in reports}
    if named:
        return Finding(step, {r: ["logits"] for r in named}, named, hosts, True)
    return Finding(step, {r: ["logits"] for r in suspects}, {r: "buddy" for r in suspects}, hosts, False)


@dataclass
class Replay:
    """An unattributed finding awaiting the replay of its steps: the logits fingerprints of the steps since the last
    check and the first replayed step that differed."""

    finding: Finding
    witnesses: dict[int, int]  # step -> the logits fingerprint the first time
    diverged: int | None = None


class SdcCheck:
    """The fingerprints of one rank's parameters, recorded after the update of each check step and verified then,
    before the step's snapshot is taken. Every rank gathers every report over the control group, so all decide
    alike. Between checks, a replicated slice that changes shows at the next check (its replicas then differ); a
    slice no other rank holds has no second copy (and under zero1 a changed copy is overwritten by the owner's next
    update), so it is fingerprinted after every update (`rested`) and again before the next one (`watch`): both stay
    on the device, and only the check reads which ones changed.

    The fingerprint of the rank's logits of each step since the last check is kept (a 0-d device tensor, no sync):
    when two replicas disagree and neither is the majority, the run rolls back and replays those steps, and the
    rank whose replayed logits differ from the original's is the one that computed with corrupted weights. At a
    spike the step's forward is replayed at once, here and on the next rank (`replay_on_buddy`)."""

    def __init__(
        self,
        interval: int,
        parts: list[nn.Module],
        rank: int,
        group: dist.ProcessGroup | None,
        *,
        watch_all: bool = False,
        spikes: bool = False,
    ) -> None:
        self.interval = interval
        self.rank = rank
        self.group = group
        self.host = socket.gethostname()
        self.params = [(n, p) for part in parts for n, p in part.named_parameters()]
        self.names = [n for n, _ in self.params]
        self.keys = [_slice_key(n, p) for n, p in self.params]
        holders = self._holders()
        # Watched at rest at every step: the slices only this rank holds, or every slice where a copy changed at
        # rest would be overwritten by its owner's next update (`watch_all`: zero1) before a check could compare it.
        watch = [watch_all or holders[k] == 1 for k in self.keys]
        self.watched = [p for (_, p), w in zip(self.params, watch, strict=True) if w]
        self._watched_names = [n for n, w in zip(self.names, watch, strict=True) if w]
        # Their fingerprints after the last update, and which of them changed before a later one since the check.
        self._rest: torch.Tensor | None = None
        self._drift: torch.Tensor | None = None
        self.recorded: list[int] | None = None
        # step -> this rank's logits fingerprint (the replay's witness), for the steps since the last check
        self.witnesses: dict[int, torch.Tensor] = {}
        self.replay: Replay | None = None
        self._replayed: Finding | None = None  # the verdict of a replay that reached its finding's step
        # The replay's witness: the fingerprint of this rank's logits, summed over the step's micro-batches. They
        # depend on its weights and its batch only (before any gradient is averaged), and unlike the fp32 loss they
        # keep the last bit of a small change: a flipped low mantissa bit often leaves the loss's bits as they were.
        self._witness: torch.Tensor | int = 0
        # The step's forward calls (the model's arguments as its training forwards got them, and the autocast they
        # ran under), kept for one step: a spike replays them here and on the buddy (`replay_on_buddy`).
        self._calls: list[tuple[int, tuple, dict, tuple[bool, torch.dtype]]] = []
        self.calls: dict[int, list] = {}
        self._replaying = False
        # The reports of the last replay_on_buddy (None: nothing was replayed).
        self.buddy_reports: list[BuddyReport] | None = None
        self.models = [m for part in parts for m in part.modules()
                       if isinstance(m, Transformer) and m.output is not None]  # fmt: skip
        ties = any(n >= 2 and n % 2 == 0 for n in holders.values())
        if not (ties or spikes):
            return  # no slice held by an even number of ranks, no spike to replay: nothing reads the witness
        for i, m in enumerate(self.models):
            m.output.register_forward_hook(self._witness_hook)
            m.register_forward_pre_hook(partial(self._call_hook, i), with_kwargs=True)

    def _holders(self) -> Counter:
        """How many ranks of the group hold each slice key (a collective at setup)."""
        if self.group is None or dist.get_world_size(self.group) == 1:
            return Counter(set(self.keys))
        everyone: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, self.keys, group=self.group)
        return Counter(k for keys in everyone for k in set(keys))

    def due(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    @staticmethod
    def _prints(params: list[torch.Tensor]) -> torch.Tensor | None:
        """The fingerprints of `params`, one 1-d device tensor (None when there are none); nothing is read yet."""
        return torch.stack([fingerprint(_local(p)) for p in params]) if params else None

    def _witness_hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        """The output layer's training forwards (and replays): add this micro-batch's logits' fingerprint to the
        step's."""
        if module.training or self._replaying:
            self._witness = self._witness + fingerprint(_local(output))

    def _call_hook(self, index: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The model's training forwards: keep what it was called with (references, no copy)."""
        if args and module.training and torch.is_grad_enabled() and not self._replaying:
            device = _local(args[0]).device.type
            autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            self._calls.append((index, args, kwargs, autocast))

    def observe(self, step: int) -> None:
        """Keep this step's logits fingerprint (no device read); during a replay, compare it with the original."""
        witness, self._witness = self._witness, 0
        self.calls, self._calls = {step: self._calls}, []
        if not isinstance(witness, torch.Tensor):
            return  # no output layer on this rank
        if self.replay is not None and step in self.replay.witnesses and self.replay.diverged is None:
            replayed = int(witness.item())
            if replayed != self.replay.witnesses[step]:
                self.replay.diverged = step
                log.warning(
                    "replay: rank %d's logits at step %d differ from the first time's", self.rank, step
                )
        self.witnesses[step] = witness

    def watch(self) -> None:
        """Before an update: whether the unreplicated slices still hold what the last update wrote (on the device)."""
        if self._rest is None:
            return  # no update since the (re)start or rollback
        changed = self._prints(self.watched) != self._rest
        self._drift = changed if self._drift is None else self._drift | changed

    def rested(self) -> None:
        """Right after every applied update: what the unreplicated slices must hold until the next one."""
        self._rest = self._prints(self.watched)

    def record(self, step: int) -> None:
        """Right after the update of a check step: what this rank's parameters must hold until the next update."""
        prints = self._prints([p for _, p in self.params])
        self.recorded = [] if prints is None else prints.tolist()  # one device read

    def verify(self, step: int, where: str) -> Finding | None:
        """Every rank's fingerprints now against its record and its replicas' (a collective on the control group:
        every rank calls it at the same step)."""
        assert self.recorded is not None, "verify() before record()"
        replaying = self.replay is not None and step == self.replay.finding.step
        current = self._prints([p for _, p in self.params])
        drift = [] if self._drift is None else self._drift.tolist()
        self._drift = None
        mine = Report(self.rank, self.host, self.keys, self.recorded, [] if current is None else current.tolist(),
                      self.names, self.replay.diverged if replaying else None,
                      [n for n, d in zip(self._watched_names, drift) if d])  # fmt: skip
        reports = [mine]
        if self.group is not None and dist.get_world_size(self.group) > 1:
            reports = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(reports, mine, group=self.group)
        finding = attribute(step, reports)
        if finding is not None:
            finding.where = where
        if where == "after_update" and finding is None:
            self.witnesses = {}  # a passed check: the next window starts
        if replaying:
            self._replayed = attribute_by_replay(self.replay.finding, reports)
            self.replay = None
        return finding

    def replay_on_buddy(self, step: int) -> Finding | None:
        """A spike: replay the step's forward (same weights, before the update) on this rank and on its right
        neighbour, and compare the logits' fingerprints bitwise (`attribute_by_buddy`). Every rank replays its own
        batches, then its left neighbour's (the same number: an FSDP forward is a collective). A collective on the
        control group; the batches travel over it (token ids: small)."""
        self.buddy_reports = None
        if self.group is None or dist.get_world_size(self.group) == 1:
            return None
        mine = [
            (i, _to(args, "cpu"), _to(kwargs, "cpu"), ac) for i, args, kwargs, ac in self.calls.get(step, [])
        ]
        everyone: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        if not all(everyone):
            return None  # a rank without the model's forward calls (no Transformer): nothing to replay
        at = dist.get_group_rank(self.group, self.rank)
        left = everyone[(at - 1) % len(everyone)]
        original = self.witnesses.get(step)
        report = BuddyReport(self.rank, self.host, None if original is None else int(original.item()),
                                self._replay(self.calls[step]), self._replay(left))  # fmt: skip
        reports: list = [None] * len(everyone)
        dist.all_gather_object(reports, report, group=self.group)
        self.buddy_reports = reports
        return attribute_by_buddy(step, reports)

    def _replay(self, calls: list) -> int | None:
        """The fingerprint of the logits of `calls` computed again: no gradient, eval mode (nothing a training
        forward measures, such as QK-clip's logit maximum, sees the replay), the autocast of the first time."""
        training = [m.training for m in self.models]
        self._witness, self._replaying = 0, True
        try:
            with torch.no_grad():
                for m in self.models:
                    m.eval()
                for i, args, kwargs, (enabled, dtype) in calls:
                    device = self.models[i].output.weight.device
                    with torch.autocast(device.type, dtype=dtype, enabled=enabled):
                        self.models[i](*_to(args, device), **_to(kwargs, device))
        finally:
            for m, t in zip(self.models, training, strict=True):
                m.train(t)
            self._replaying = False
        witness, self._witness = self._witness, 0
        return int(witness.item()) if isinstance(witness, torch.Tensor) else None

    def suspect(self, finding: Finding) -> None:
        """An unattributed finding: keep the window's logits fingerprints for its replay after the rollback."""
        self.replay = Replay(finding, {s: int(v.item()) for s, v in self.witnesses.items()})

    def replayed(self) -> Finding | None:
        """The verdict of the replay that just reached its finding's step (once), else None."""
        verdict, self._replayed = self._replayed, None
        return verdict

    def reset(self) -> None:
        """After a rollback: the restored weights have no record yet."""
        self.recorded, self.witnesses, self._rest, self._drift = None, {}, None, None


def exclude_hosts(run_dir: Path, hosts: list[str], step: int) -> Path:
    """resilience.sdc_exclude: add `hosts` to <run_dir>/excluded_hosts.json (written aside and renamed in)."""
    path = Path(run_dir) / EXCLUDED_FILE
    marked = excluded_hosts(run_dir)
    for h in hosts:
        marked.setdefault(h, step)
    tmp = path.with_name(f"{EXCLUDED_FILE}.tmp.{os.getpid()}")
    tmp.write_text(json.dumps(marked, indent=1))
    os.replace(tmp, path)
    return path


def excluded_hosts(run_dir: Path) -> dict[str, int]:
    """The hosts an SDC finding marked bad in this run, with the step of the finding ({} when none)."""
    try:
        marked = json.loads((Path(run_dir) / EXCLUDED_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return marked if isinstance(marked, dict) else {}


def excluded_here(run_dir: Path, host: str | None = None) -> str | None:
    """Why this host may not (re)start workers of the run, or None: the launcher asks before each attempt."""
    host = host or socket.gethostname()
    marked = excluded_hosts(run_dir)
    if host not in marked:
        return None
    return (
        f"host {host} is excluded from this run: silent data corruption was found on it at step {marked[host]} "
        f"(resilience.sdc_exclude; {Path(run_dir) / EXCLUDED_FILE}). Start the run on other hosts, or, once the "
        "host is repaired or replaced, remove it from that file"
    )


def sdc_problems(r: ResilienceConfig, c: CheckpointConfig) -> list[str]:
    """resilience.sdc_interval: a finding rolls back to the newest snapshot, which must hold verified weights: the
    periodic snapshots fall on check steps (each is taken after its step's check passed)."""
    n = r.sdc_interval
    if n < 0:
        return [f"resilience.sdc_interval must be >= 0 (0: off), got {n}"]
    if n == 0:
        return ["resilience.sdc_exclude needs resilience.sdc_interval > 0"] if r.sdc_exclude else []
    sources = [("checkpoint.snapshot_interval", c.snapshot_interval)]
    if c.enabled and isinstance(c.interval, int):
        sources.append(("checkpoint.interval", c.interval))
    on = [(key, v) for key, v in sources if v > 0]
    if not on:
        return [
            f"resilience.sdc_interval {n} needs a snapshot to roll back to: set checkpoint.snapshot_interval (the "
            f"memory tier) or checkpoint.interval to a multiple of {n}; without one a finding could only stop the "
            "run, the corrupted weights kept"
        ]
    return [
        f"{key} {v} must be a multiple of resilience.sdc_interval {n}: a snapshot between two checks could hold "
        "corrupted weights that a rollback would restore"
        for key, v in on
        if v % n
    ]


def sdc_layout_problems(cfg: Config) -> list[str]:
    """resilience.sdc_interval runs where it is tested (tests/e2e/test_sdc.py): one process and every data-parallel
    mode (ddp, zero1, zero2, fsdp, hsdp)."""
    p = cfg.parallel
    if cfg.resilience.sdc_interval <= 0:
        return []
    untested = [f"parallel.{k} {getattr(p, k)}" for k in ("tp", "pp", "cp", "ep") if getattr(p, k) > 1]
    if cfg.fault_tolerance.enabled:
        untested.append("fault_tolerance.enabled")
    if not untested:
        return []
    return [
        f"resilience.sdc_interval is tested with data parallelism only (ddp, zero1, zero2, fsdp, hsdp), not with "
        f"{', '.join(untested)}: use one of those layouts, or resilience.sdc_interval 0"
    ]
