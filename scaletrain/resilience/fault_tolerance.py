"""Replica groups that keep training when one of them fails, on torchft (`[fault_tolerance]`, docs/resilience.md).

`scaletrain train --nproc N` with fault_tolerance.enabled starts G replica groups of N/G ranks, each under its own
elastic agent (launch.launch_groups), and a torchft lighthouse on loopback (or uses fault_tolerance.lighthouse).
Each group is one data-parallel replica: fsdp or ddp inside it as without fault tolerance, and across groups the
gradients of every step are averaged by torchft's Manager over the groups in the step's quorum (ReplicaGroup.sync).

A group that loses a rank stops (its agent restarts it); the others see the failed collective, do not commit that
step and run it again with the groups left: the global batch shrinks to the slices of the groups present (the
samples of an absent group's slice are dropped, never trained twice: each group reads its fixed slice of every
global batch, a function of the step). The restarted group asks for a quorum at step 0, torchft sees it behind and
sends it the weights, optimizer state, data position and step of a live peer over its checkpoint transport (HTTP),
and it takes part in the next step. torchft is imported only here, only when the feature is on.

Group 0 owns the run directory (metrics, events, checkpoints as without fault tolerance); group g > 0 writes its
metrics and events under <run dir>/replicas/group-g and saves no checkpoint: it heals from a peer instead.

Across nodes (fault_tolerance.group), each node's command starts one group; every server a group starts (its store,
the ManagerServer, the checkpoint transport) binds fault_tolerance.address, never every interface (ft_servers).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from scaletrain.config import CheckpointConfig, Config, FaultToleranceConfig
from scaletrain.metrics.writer import append_event
from scaletrain.run.directory import EVENTS, read_jsonl

if TYPE_CHECKING:
    from scaletrain.parallel import DistEnv

GROUP_ENV = (
    "SCALETRAIN_FT_GROUP"  # this worker's replica group (set by launch_groups for its group's launcher)
)
MAIN_RUN_ENV = "SCALETRAIN_FT_RUN_DIR"  # the run directory group 0 owns, where replica events go
LIGHTHOUSE_ENV = "SCALETRAIN_FT_LIGHTHOUSE"
GROUPS_ENV = "SCALETRAIN_FT_GROUPS"  # G, for the worker's validation of the whole job
BARRIER_ENV = (
    "SCALETRAIN_FT_BARRIER"  # host:port of the launcher's store: the first quorum waits for all groups
)
INSTALL = "pip install 'scaletrain[ft]' (torchft 0.2.0)"
FINAL_WAIT_S = 300.0  # how long the last step waits for a restarting group to rejoin
HEARTBEAT_TIMEOUT_MS = 2000  # a group silent this long is out of the quorum (torchft's default: 5000)


def torchft_installed() -> bool:
    return importlib.util.find_spec("torchft") is not None


def problems(cfg: Config, world_size: int) -> list[str]:
    """What fault_tolerance.enabled cannot serve for this config on `world_size` ranks, each with its reason."""
    ft = cfg.fault_tolerance
    if not ft.enabled:
        return []
    if not torchft_installed():
        return [f"fault_tolerance.enabled needs torchft, which is not installed: {INSTALL}"]
    g, p = ft.replica_groups, cfg.parallel
    out = []
    if g < 2:
        out.append(
            f"fault_tolerance.replica_groups must be >= 2 (got {g}): one group has no peer to heal from"
        )
    elif world_size % g:
        out.append(
            f"fault_tolerance.replica_groups {g} must divide --nproc {world_size} (N/G ranks per group)"
        )
    if not 1 <= ft.min_replicas <= max(g, 1):
        out.append(f"fault_tolerance.min_replicas must be in 1..replica_groups ({g}), got {ft.min_replicas}")
    if ft.timeout_s <= 0:
        out.append(f"fault_tolerance.timeout_s must be > 0, got {ft.timeout_s}")
    # Issue 34: without a restart the group would never come back, and the others wait for it.
    if cfg.resilience.max_restarts < 1:
        out.append(
            f"fault_tolerance.enabled with resilience.max_restarts {cfg.resilience.max_restarts}: a group that "
            f"loses a rank is never restarted, so it never rejoins, and the other groups wait {FINAL_WAIT_S:.0f} s "
            "for it at the last step and then fail the job; give --max-restarts N (N >= 1 restarts for each group)"
        )
    out += _placement(ft)
    if max(p.tp, p.pp, p.cp, p.ep, p.dp_replicate) > 1:
        out.append(
            "fault_tolerance replica groups hold fsdp or ddp inside (parallel.dp_shard); tp, pp, cp, ep and "
            "dp_replicate > 1 inside a group have not been tested against the reference: set them to 1"
        )
    if p.data_parallel not in ("ddp", "fsdp"):
        out.append(
            f"fault_tolerance with parallel.data_parallel = {p.data_parallel!r}: only ddp and fsdp inside a group "
            "are tested (hsdp: the groups are the replicate dimension; use fsdp inside them)"
        )
    out += _refused_companions(cfg)
    if g >= 2 and world_size % g == 0:
        dp = world_size // g
        per_step = cfg.training.micro_batch * dp * g
        if cfg.training.global_batch % per_step:
            out.append(
                f"fault_tolerance: training.global_batch {cfg.training.global_batch} must be a multiple of "
                f"micro_batch x ranks ({per_step}) so that every group reads an equal slice"
            )
    return out


def _placement(ft: FaultToleranceConfig) -> list[str]:
    """fault_tolerance.group and address: one group per command, across nodes."""
    out = []
    if not -1 <= ft.group < ft.replica_groups:
        out.append(f"fault_tolerance.group must be in 0..{ft.replica_groups - 1} (or -1: all groups here), "
                   f"got {ft.group}")  # fmt: skip
    if ft.group >= 0 and not (ft.lighthouse and ft.address):
        out.append(
            "fault_tolerance.group starts one group on this node: give fault_tolerance.lighthouse (the "
            "torchft_lighthouse every group reaches, http://host:port) and fault_tolerance.address (this node's "
            "address on the cluster network, which the group's servers bind)"
        )
    if ft.address and _resolve(ft.address) is None:
        out.append(f"fault_tolerance.address {ft.address!r} does not resolve to an address of this host")
    return out


def _resolve(host: str) -> str | None:
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, IndexError):
        return None


def bind_address(ft: FaultToleranceConfig) -> str:
    """The address every server of a replica group binds (its store, ManagerServer and checkpoint transport):
    fault_tolerance.address, resolved once here; 127.0.0.1 without it (or without fault tolerance)."""
    return (ft.enabled and ft.address and _resolve(ft.address)) or "127.0.0.1"


def _refused_companions(cfg: Config) -> list[str]:
    out = []
    if cfg.training.device.startswith("cuda"):
        out.append(
            "fault_tolerance runs on CPU (gloo) here: torchft's NCCL path is not tried in this project"
        )
    if cfg.precision.compute == "fp16":
        out.append("fault_tolerance with fp16: the loss scaler's skip decision is not agreed across groups")
    if cfg.training.batch_ramp or cfg.training.global_batch_tokens:
        out.append(
            "fault_tolerance needs a fixed training.global_batch (no batch_ramp / global_batch_tokens)"
        )
    if cfg.training.eval_interval:
        out.append(
            "fault_tolerance with training.eval_interval > 0: each group would evaluate only its share of the "
            "held-out data; set training.eval_interval = 0"
        )
    if cfg.parallel.grad_compression != "none":
        out.append("fault_tolerance with parallel.grad_compression: the cross-group average is uncompressed")
    if cfg.resilience.spike_zscore > 0:
        out.append(
            "fault_tolerance with resilience.spike_zscore: a rollback loads a checkpoint, which only group 0 has"
        )
    if cfg.training.steps < 1:
        out.append("fault_tolerance needs training.steps >= 1")
    return out


def this_group() -> int | None:
    """The replica group of this process (a worker, or its group's launcher); None without fault tolerance."""
    value = os.environ.get(GROUP_ENV)
    return int(value) if value is not None else None


def data_slice(dp_rank: int, dp_size: int, ft: FaultToleranceConfig) -> tuple[int, int]:
    """(data-parallel rank, size) for the loader: group g's ranks read slice g of every global batch."""
    group = this_group()
    if group is None:
        return dp_rank, dp_size
    return group * dp_size + dp_rank, ft.replica_groups * dp_size


def group_checkpoint(c: CheckpointConfig) -> CheckpointConfig:
    """Only group 0 saves (both tiers, as without fault tolerance); a restarted group g > 0 heals from a peer."""
    return c if not this_group() else replace(c, enabled=False, snapshot_interval=0)


def global_rank(rank: int, group_size: int) -> int:
    """A rank counted over all groups (what resilience.inject's rank means)."""
    return rank + (this_group() or 0) * group_size


def group_run_dir(main: Path, group: int) -> Path:
    """Where group `group` writes: the run directory itself for group 0, <run dir>/replicas/group-g otherwise."""
    return Path(main) if group == 0 else Path(main) / "replicas" / f"group-{group}"


def start_lighthouse(ft: FaultToleranceConfig) -> tuple[Any, str]:
    """A torchft lighthouse on loopback for a local job: (server, http address)."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=ft.min_replicas, join_timeout_ms=1000,
                              heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)  # fmt: skip
    port = server.address().rsplit(":", 1)[1]
    return server, f"http://127.0.0.1:{port}"


def replica_group(cfg: FaultToleranceConfig, env: DistEnv, state: dict, event: Callable[..., None], final: int,
                  stop: Callable[[], bool], new_window: Callable[[], None]) -> ReplicaGroup | NoReplicaGroup:  # fmt: skip
    """This rank's side of its replica group (`state`, `event`, `final`, `stop`, `new_window`: ReplicaGroup's);
    NoReplicaGroup without fault tolerance."""
    group = this_group()
    if group is None:
        return NoReplicaGroup()
    return ReplicaGroup(cfg, group, env.rank, env.world_size, state, event, final, stop, new_window)


class NoReplicaGroup:
    """Without fault tolerance: this job is the only replica and every step commits, so the loop calls the same
    methods either way."""

    def begin(self, step: int) -> None:
        pass

    def step_start(self, step: int) -> int:
        return step

    def sync(self, loss: torch.Tensor) -> tuple[torch.Tensor, bool]:
        return loss, True

    def stop_agreed(self) -> bool | None:
        return None  # the job's own ranks agree (Preemption)

    def describe(self) -> dict:
        return {}

    def metrics(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


class ReplicaGroup:
    """This rank's side of torchft: the quorum at each step start (healing from a peer when behind), the gradients
    and loss averaged over the groups present, and the commit vote. `state` holds the model parts, the optimizers,
    the loader and the train state (what a healing group receives); `stop()` says whether this group's ranks were
    asked to stop (SIGTERM, Ctrl-C), which sync shares with the other groups; `new_window()` restarts the throughput
    window (StepMeter.reset) after a heal."""

    def __init__(self, cfg: FaultToleranceConfig, group: int, rank: int, size: int, state: dict,
                 event: Callable[..., None], final: int, stop: Callable[[], bool],
                 new_window: Callable[[], None]) -> None:  # fmt: skip
        from torchft import Manager, ProcessGroupGloo

        from scaletrain.resilience.ft_servers import BoundHTTPTransport, manager_server_on

        self.group, self.rank, self.state, self.event = group, rank, state, event
        self._stop_requested, self._stop = stop, False
        self._new_window = new_window
        self.main_run = Path(os.environ[MAIN_RUN_ENV])
        self.healed_at: float | None = None
        self.replicas = 0
        self._first_quorum = True
        self.groups, self.final = cfg.replica_groups, final
        self._position: dict | None = None
        self._restarted = False  # an earlier process of this rank of this group started in this run (begin)
        # The group's address: its store's (launch binds it to fault_tolerance.address, or loopback), where its
        # ManagerServer and checkpoint transport listen too, and what they advertise to the other groups.
        self.address = os.environ["MASTER_ADDR"]
        timeout = timedelta(seconds=cfg.timeout_s)
        self.transport = BoundHTTPTransport(self.address, timeout)
        with manager_server_on(self.address):
            self.manager = Manager(
                pg=ProcessGroupGloo(timeout=timeout),
                load_state_dict=self._load,
                state_dict=self._save,
                min_replica_size=cfg.min_replicas,
                use_async_quorum=False,  # the quorum (and any healing) completes before the step's forward
                init_sync=False,  # every group materialises the same weights from the seed
                timeout=timeout,
                quorum_timeout=timedelta(seconds=120),
                rank=rank,
                world_size=size,
                store_addr=self.address,
                store_port=int(os.environ["MASTER_PORT"]),
                lighthouse_addr=cfg.lighthouse or os.environ[LIGHTHOUSE_ENV],
                replica_id=f"group{group}",
                hostname=self.address,
                checkpoint_transport=self.transport,
            )

    def begin(self, step: int) -> None:
        """After resuming at `step`: torchft counts committed steps from there; the first start waits for every group
        so that step 1 has them all (a restarted group goes straight on, to heal)."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        started = [e for e in read_jsonl(self.main_run / EVENTS) if e.get("kind") == "replica_started"]
        self._restarted = any(
            (e.get("group"), e.get("group_rank")) == (self.group, self.rank) for e in started
        )
        append_event(self.main_run, "replica_started", step, group=self.group, group_rank=self.rank,
                     pid=os.getpid(), address=self.address)  # fmt: skip
        barrier = os.environ.get(BARRIER_ENV)
        if barrier and self.rank == 0:
            from torch.distributed import TCPStore

            host, port = barrier.rsplit(":", 1)
            store = TCPStore(host, int(port), is_master=False, wait_for_workers=False)
            store.set(f"ft/arrived/{self.group}", "1")
            groups = int(store.get("ft/groups"))
            store.wait([f"ft/arrived/{g}" for g in range(groups)])

    def step_start(self, step: int) -> int:
        """The quorum for `step`; returns the step to run: `step`, or the peers' next step after healing.

        The first and the last step wait (up to FINAL_WAIT_S) for every group: all start together (a group whose
        heartbeat the lighthouse has not seen yet is not waited for otherwise), and a group restarting heals and
        rejoins before the end, so that the job ends with every replica holding the same weights.

        After a heal the throughput window starts again: the next record covers only the steps from the one received
        (goodput's segment starts at replica_joined), and the time before it (the heal, a restart's wait for its
        first quorum, an attempt that did not commit) is not theirs: counted as step time of the record after the
        heal, it put goodput above the steps' share (issue 26)."""
        deadline = time.monotonic() + FINAL_WAIT_S
        healed = False
        while True:
            self.manager.start_quorum()
            self.replicas = self.manager.num_participants()
            if self.healed_at is not None:
                step = self.manager.current_step() + 1
                self._joined(step - 1)
                healed = True
            self._first_quorum = False
            everyone = step in (1, self.final)  # the first and the last step wait for every group
            if not everyone or self.replicas >= self.groups or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        self._position = self.state["loader"].state_dict()
        if healed:
            self._new_window()
        return step

    def sync(self, loss: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Average this step's gradients and loss over the groups in the quorum; (loss, committed). Not committed:
        a group failed during the step, which is undone (`_retry`) for the loop to run it again with the groups left.

        The stop request goes with them: each group's ranks agree on theirs first (`stop()`), then the average over
        the groups is above 0 in every group of the quorum as soon as one group was asked, so that all stop after
        this same committed step (issue 34: each group stopped on its own step before)."""
        works = [self.manager.allreduce(_local(p.grad)) for p in self._params() if p.grad is not None]
        mean, stop = loss.detach().clone(), torch.tensor([float(self._stop_requested())])
        works += [self.manager.allreduce(mean), self.manager.allreduce(stop)]
        for work in works:
            work.wait()
        committed = self.manager.should_commit()
        if not committed:
            self._retry()
        self._stop = committed and stop.item() > 0
        return mean, committed

    def stop_agreed(self) -> bool:
        """Whether any group of the last committed step's quorum was asked to stop (sync)."""
        return self._stop

    def _retry(self) -> None:
        """Undo the step that did not commit: its gradients dropped, the loader back at the step's first sample."""
        for opt in self.state["optimizers"].optimizers:
            opt.zero_grad(set_to_none=True)
        if self._position is not None:
            self.state["loader"].load_state_dict(self._position)

    def describe(self) -> dict:
        """What the start event records of it."""
        return {"replica_group": self.group, "replica_groups": self.groups}

    def metrics(self) -> dict[str, int]:
        return {"replicas": self.replicas, "replica_group": self.group}

    def close(self) -> None:
        """Record this rank's parameters' digest (replica_done: every group's must be equal) and leave."""
        digest = hashlib.sha256()
        for p in self._params():
            digest.update(_local(p.detach()).contiguous().view(torch.uint8).numpy().tobytes())
        append_event(self.main_run, "replica_done", self.state["train"].step, group=self.group,
                     group_rank=self.rank, params_sha256=digest.hexdigest())  # fmt: skip
        self.manager.shutdown(wait=False)

    # -- the state a healing group receives (torchft calls these from its quorum thread) ------------------------

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for part in self.state["parts"] for p in part.parameters()]

    def _tensors(self) -> list[torch.Tensor]:
        """What a healing group copies of the model: the parameters and the buffers (MoE's expert_bias is trained)."""
        return self._params() + [b for part in self.state["parts"] for b in part.buffers()]

    def _save(self) -> dict:
        params = [_local(p.detach()).clone() for p in self._tensors()]
        optim = [
            {k: _local(v).clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
            for opt in self.state["optimizers"]._inner()
            for p in _opt_params(opt)
        ]
        sched = [s.last_epoch for s in self.state["optimizers"].schedulers]
        train = self.state["train"]
        return dict(params=params, optim=optim, sched=sched, loader=self.state["loader"].state_dict(),
                    step=train.step, tokens=train.tokens)  # fmt: skip

    def _load(self, sd: dict) -> None:
        with torch.no_grad():
            for p, value in zip(self._tensors(), sd["params"], strict=True):
                _local(p.data).copy_(value)
            pairs = [(opt, p) for opt in self.state["optimizers"]._inner() for p in _opt_params(opt)]
            for (opt, p), saved in zip(pairs, sd["optim"], strict=True):
                opt.state[p] = {k: _like(p, v) for k, v in saved.items()}
        optimizers = self.state["optimizers"]
        for sched, epoch in zip(optimizers.schedulers, sd["sched"], strict=True):
            sched.last_epoch = epoch - 1
            sched.step()  # sets the learning rate of that step
        self.state["loader"].load_state_dict(sd["loader"])
        self.state["train"].step, self.state["train"].tokens = sd["step"], sd["tokens"]
        self.healed_at = time.time()

    def _joined(self, step: int) -> None:
        """replica_joined: after a restart (heal_s: from the failure its launcher recorded to the weights received;
        none where the group's node died with its launcher), or after falling behind while alive (a quorum of the
        others committed a step without it). `source`: the peer's checkpoint server the state came from."""
        lost = [e for e in read_jsonl(self.main_run / EVENTS)
                if e.get("kind") == "replica_lost" and e.get("group") == self.group]  # fmt: skip
        restarted = lost or self._restarted
        cause = ("restarted" if restarted else "started") if self._first_quorum else "fell_behind"
        heal_s = round(self.healed_at - lost[-1]["time"], 3) if cause == "restarted" and lost else None
        if self.rank == 0:
            fields = dict(group=self.group, heal_s=heal_s, cause=cause, replicas=self.replicas,
                          source=self.transport.received_from)  # fmt: skip
            append_event(self.main_run, "replica_joined", step, **fields)
            if self.group:  # group 0's own events are the main run's
                self.event("replica_joined", step=step, **fields)
        self.healed_at = None


def _opt_params(opt: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for group in opt.param_groups for p in group["params"]]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(p: torch.Tensor, value: Any) -> Any:
    """A received optimizer state entry as this rank's: moments shaped like the parameter become DTensors like it."""
    if not isinstance(value, torch.Tensor) or not isinstance(p, DTensor) or value.dim() == 0:
        return value
    return DTensor.from_local(value.clone(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
