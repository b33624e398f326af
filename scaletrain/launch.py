"""Run training in this process, or start N local workers through torchrun's elastic agent (`--nproc N`).

The launcher validates the config, fixes the run directory and tokenises the data once, so that workers start
on a checked config and a warm data cache, and a bad input is reported before any worker starts. The worker
entry and its crash path live here too, and how the launcher stops its workers on a signal (_Stop): the CLI calls
into this module, never the other way round.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import re
import signal
import socket
import sys
import time
import traceback
import uuid
from multiprocessing.connection import Connection
from pathlib import Path
from types import FrameType

import torch.distributed as dist
from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs, SignalException, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, create_handler
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from scaletrain.config import Config
from scaletrain.data import load_tokenizer, prepare_data
from scaletrain.errors import INTERRUPTED_EXIT_CODE, STOPPED_EXIT_CODE, UserError, report_errors
from scaletrain.metrics.writer import append_event
from scaletrain.resilience import fault_tolerance
from scaletrain.resilience.diagnose import (
    Diagnosis,
    RestartPolicy,
    classify,
    read_error_file,
    root_cause,
    tail,
)
from scaletrain.resilience.membership import record_lost_peer
from scaletrain.resilience.preemption import Lifelines, die_with_parent, follow_launcher
from scaletrain.resilience.sdc import excluded_here
from scaletrain.resilience.timelimit import JOB_START_ENV
from scaletrain.run.directory import EVENTS, LOGS, RunDir, read_jsonl
from scaletrain.validate import load_config

log = logging.getLogger("scaletrain")

LINGER_S = 3.0  # many times the agent's monitor interval (0.1 s)
STOP_GRACE_S = 300.0
"""The least time the workers get after the launcher's SIGTERM to reach a step boundary and save, before they are
killed (stop_grace): the grace our Kubernetes example gives a pod (terminationGracePeriodSeconds: 300), so that the
launcher never cuts short a save that its scheduler would let finish. It costs nothing when the save is quick (the
launcher exits as soon as the workers do), and a scheduler with a shorter grace (Slurm's KillWait and Kubernetes'
default are 30 s) kills the launcher sooner anyway, the workers with it."""
# The signals torch's agent handles under launch_local: all but SIGTERM and Ctrl-C, the launcher's own (_Stop).
TORCH_SIGNALS = "SIGHUP,SIGQUIT"


def install_stack_dump() -> None:
    """`kill -USR1 <pid>` prints every thread's stack to stderr and carries on: how a stuck run is looked into."""
    with contextlib.suppress(
        AttributeError, OSError, ValueError
    ):  # stderr without a descriptor (embedded, tests)
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def run_training(cfg: Config) -> int:
    """Train in this process. A UserError or Ctrl-C propagates (the caller prints it); any other failure prints
    its traceback and ends the process at once with status 1: a background checkpoint upload blocked on a dead
    peer would otherwise hold the process (and its agent's restart) until the collective timeout.

    Returns the exit status: STOPPED_EXIT_CODE when run.time_limit or run.stop_at_step ended the job early, but 0
    under an elastic agent, which takes any other status for a failure (it stops the peers and restarts them): its
    launcher reads the stop back from events.jsonl (RunDir.exit_code)."""
    if cfg.run.dir and (why := excluded_here(Path(cfg.run.dir))):  # resilience.sdc_exclude marked this host
        raise UserError(why)
    from scaletrain.train import train  # here, not at the top: the agent and launcher processes never train

    try:
        stopped = train(cfg)["stopped"]
    except (UserError, KeyboardInterrupt):
        raise
    except BaseException:
        text = traceback.format_exc()
        sys.stderr.write(text)
        sys.stderr.flush()
        if cfg.run.dir:
            record_lost_peer(RunDir.at(cfg.run.dir), text)  # a surviving node names the one that went away
        _linger_if_a_peer_failed(text)
        os._exit(1)
    # Ended normally: the process group goes before the interpreter. Left to its finalisation, gloo's worker threads
    # can still hold work with tensors in it, and one rank of a finished simulated-node run died of SIGABRT at exit
    # ("terminate called without an active exception"), which its agent reports as a failed run.
    if dist.is_initialized():
        dist.destroy_process_group()
    if stopped == "interrupted":  # a first Ctrl-C: stopped after a step, saved (Preemption)
        print("\ninterrupted (Ctrl-C): stopped after a step and saved it", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    return STOPPED_EXIT_CODE if stopped and not under_torchrun() else 0


def _linger_if_a_peer_failed(error: str) -> None:
    """A rank whose collective broke because a peer died waits before exiting, so that the agent, which reports
    the first worker it finds dead, finds the peer that failed (killed, out of memory) rather than this one. The
    agent ends the wait at once: it stops the other workers with SIGTERM as soon as it sees a failure."""
    if under_torchrun() and classify(1, None, error).kind == "collective_timeout":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the preemption handler: the agent's stop ends us
        time.sleep(LINGER_S)


def worker_main(lifelines: tuple[Connection, ...], config_path: str, *overrides: str) -> None:
    """A worker of launch_local, in a process forked from the warm fork server: load the config the launcher
    checked (the run directory is its own job's, so it is not checked again) and train."""
    # The fork server ignores and blocks SIGTERM (_start_fork_server): take it back. Until the trainer's Preemption
    # handler is in place SIGTERM ends a starting worker, as the agent expects when it stops a group whose peer
    # failed (a worker that ignored it would wait in the rendezvous for the dead peer until its SIGKILL).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    # Ctrl-C reaches the whole process group; the launcher passes it on as a stop over the lifelines (_Stop).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    follow_launcher(lifelines, int(os.environ["LOCAL_RANK"]))
    install_stack_dump()
    sys.stdout.reconfigure(line_buffering=True)  # its stdout is a log file: keep lines up to a SIGKILL
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if fault_tolerance.this_group() is not None:  # validated as the whole job: G groups of this size
        world *= int(os.environ[fault_tolerance.GROUPS_ENV])

    def work() -> int:
        run_training(load_config(config_path or None, list(overrides), world_size=world, check_run_dir=False))
        return 0

    code = report_errors(work)
    if code:
        sys.exit(code)


def launch_local(
    cfg: Config, config_path: str | None, overrides: list[str], nproc: int, max_restarts: int
) -> int:
    """Run the job, and when a worker fails: diagnose why, write it to events.jsonl, and restart the group (which
    resumes from the newest complete checkpoint) unless the cause is one a restart cannot cure. SIGTERM ends it
    after a committed save with status 0, Ctrl-C with 130, neither with a traceback (_Stop)."""
    if cfg.fault_tolerance.enabled and fault_tolerance.this_group() is None:
        return launch_groups(cfg, config_path, overrides, nproc, max_restarts)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"
    )
    run_dir = Path(cfg.run.dir)  # the CLI resolved it (scaletrain.run.directory)
    # Tokenised once here, not by each worker; a streamed source (data.streaming) is read as it trains.
    if not cfg.data.streaming:
        prepare_data(cfg.data, load_tokenizer(cfg.data.tokenizer), log=log.info)
    worker_args = [*overrides, "--run.dir", str(run_dir)]
    if cfg.run.name:
        worker_args += ["--run.name", cfg.run.name]
    # Each worker sets its own thread count (training.threads); this only silences torchrun's OMP warning.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # run.time_limit counts from here for every attempt: the fork server, started below, hands it to the workers.
    os.environ.setdefault(JOB_START_ENV, f"{time.time():.3f}")
    run_dir.mkdir(parents=True, exist_ok=True)
    logs = _start_log_dir(run_dir)
    start = str(logs.relative_to(run_dir))
    append_event(run_dir, "job_start", None, nproc=nproc, max_restarts=max_restarts, logs=start)
    # The workers' store: on loopback, or a replica group's cluster address (fault_tolerance.address).
    host = fault_tolerance.bind_address(cfg.fault_tolerance)
    with _Stop(run_dir) as stop:
        try:
            return _attempts(
                stop, run_dir, logs, nproc, max_restarts, [config_path or "", *worker_args], host
            )
        except SignalException as e:
            return stop.exit_code(e, logs)


def _attempts(stop: _Stop, run_dir: Path, logs: Path, nproc: int, max_restarts: int, args: list[str],
              host: str) -> int:  # fmt: skip
    policy = RestartPolicy(max_restarts)
    attempt = 0
    while not stop.requested:
        # resilience.sdc_exclude: this host corrupted data; start nothing on it
        if why := excluded_here(run_dir):
            append_event(run_dir, "stopped", None, cause="excluded_host", reason=why)
            print(f"error: {why}", file=sys.stderr)
            return 1
        log_dir = logs / f"attempt-{attempt}"
        log.info("launching %d worker(s) (attempt %d); run directory %s", nproc, attempt, run_dir)
        _start_fork_server()
        try:
            _run_workers(nproc, log_dir, args, stop, host)
            # 130 after a Ctrl-C's saved stop; else 0, or STOPPED_EXIT_CODE when the workers stopped early.
            return stop.stopped_code() if stop.interrupted else RunDir(run_dir).exit_code()
        except ChildFailedError as e:
            diag, rank = _diagnose(e, log_dir)
            killed = all(f.exitcode == -signal.SIGTERM for f in e.failures.values())
        append_event(
            run_dir, "failure", diag.step, rank=rank, cause=diag.kind, detail=diag.detail, attempt=attempt
        )
        if (group := fault_tolerance.this_group()) is not None:  # the other groups go on without this one
            main = Path(os.environ[fault_tolerance.MAIN_RUN_ENV])
            append_event(main, "replica_lost", diag.step, group=group, group_rank=rank, cause=diag.kind)
        if stop.requested:
            # SIGTERM ends a worker whose Preemption handler is not in place yet: it had trained nothing to save.
            if killed:
                log.warning("the stop came before the workers trained: nothing to save")
                return stop.stopped_code()
            print(
                f"error: rank {rank} failed while stopping ({diag.kind}: {diag.detail}). Logs: {log_dir}",
                file=sys.stderr,
            )
            return 1
        restart, reason = policy.decide(diag)
        if not restart:
            append_event(run_dir, "stopped", diag.step, cause=diag.kind, reason=reason)
            print(
                f"error: rank {rank} failed ({diag.kind}: {diag.detail}); not restarting: {reason}. "
                f"Logs: {log_dir}",
                file=sys.stderr,
            )
            return 1
        attempt += 1
        append_event(run_dir, "restart", diag.step, attempt=attempt, cause=diag.kind, rank=rank)
        log.warning(
            "rank %d failed (%s: %s); restart %d of %d", rank, diag.kind, diag.detail, attempt, max_restarts
        )
    log.warning("the stop came before the workers started: nothing to save")
    return stop.stopped_code()


def launch_groups(
    cfg: Config, config_path: str | None, overrides: list[str], nproc: int, max_restarts: int
) -> int:
    """fault_tolerance: G replica groups of nproc/G workers, each a launch_local of its own (its own agent, restarts
    and logs) in a process of its own, and a torchft lighthouse on loopback unless fault_tolerance.lighthouse names
    one. SIGTERM and Ctrl-C go on to every group's launcher. Returns the first non-zero status, else 0.

    With fault_tolerance.group set, this node's group only, in this process: the lighthouse and the other groups
    run elsewhere (each node's command starts its own), and the first step waits for every group to join."""
    ft, run_dir = cfg.fault_tolerance, Path(cfg.run.dir)
    env = {fault_tolerance.MAIN_RUN_ENV: str(run_dir), fault_tolerance.GROUPS_ENV: str(ft.replica_groups)}
    if ft.group >= 0:
        log.info("fault tolerance: replica group %d of %d, %d worker(s) on %s; lighthouse %s", ft.group,
                 ft.replica_groups, nproc // ft.replica_groups, ft.address, ft.lighthouse)  # fmt: skip
        env[fault_tolerance.LIGHTHOUSE_ENV] = ft.lighthouse
        group_dir = str(fault_tolerance.group_run_dir(run_dir, ft.group))
        return _run_group(ft.group, env, config_path, overrides, group_dir, nproc, max_restarts)
    lighthouse, address = (None, ft.lighthouse) if ft.lighthouse else fault_tolerance.start_lighthouse(ft)
    barrier = bound_store()  # the first quorum waits until every group is up (ReplicaGroup.begin)
    barrier.set("ft/groups", str(ft.replica_groups))
    env[fault_tolerance.LIGHTHOUSE_ENV] = address
    env[fault_tolerance.BARRIER_ENV] = f"127.0.0.1:{barrier.port}"
    log.info("fault tolerance: %d replica groups of %d worker(s); lighthouse %s", ft.replica_groups,
             nproc // ft.replica_groups, address)  # fmt: skip
    ctx = multiprocessing.get_context("spawn")
    groups = []
    for g in range(ft.replica_groups):
        args = (
            g,
            env,
            config_path,
            overrides,
            str(fault_tolerance.group_run_dir(run_dir, g)),
            nproc,
            max_restarts,
        )
        groups.append(ctx.Process(target=_group_main, args=args, name=f"replica-group-{g}"))
        groups[-1].start()

    def forward(signum: int, frame: FrameType | None) -> None:
        for p in groups:
            if p.pid is not None and p.exitcode is None:
                os.kill(p.pid, signum)

    saved = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for p in groups:
            p.join()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        if lighthouse is not None:
            lighthouse.shutdown()
    return next((p.exitcode for p in groups if p.exitcode), 0)


def _group_main(group: int, env: dict[str, str], config_path: str | None, overrides: list[str], run_dir: str,
                nproc: int, max_restarts: int) -> None:  # fmt: skip
    """One replica group's launcher, in a process of its own (launch_groups). It dies with the job's launcher, even
    by SIGKILL, and its workers with it (their lifelines): killed alone, the job's launcher left the groups training
    on (issue 34)."""
    die_with_parent()
    sys.exit(_run_group(group, env, config_path, overrides, run_dir, nproc, max_restarts))


def _run_group(group: int, env: dict[str, str], config_path: str | None, overrides: list[str], run_dir: str,
               nproc: int, max_restarts: int) -> int:  # fmt: skip
    """One replica group's launcher: launch_local for its nproc/G workers, writing into its own run directory."""
    os.environ.update(env)
    os.environ[fault_tolerance.GROUP_ENV] = str(group)
    args = [*overrides, "--run.dir", run_dir]
    cfg = load_config(config_path, args, world_size=nproc, check_run_dir=False)
    return launch_local(cfg, config_path, args, nproc // cfg.fault_tolerance.replica_groups, max_restarts)


def stop_grace(run_dir: Path) -> float:
    """Seconds the workers get after the launcher's SIGTERM to reach a step boundary and save, before they are
    killed: STOP_GRACE_S, or 3x the slowest save this run has measured (its checkpoint_saved events) if longer."""
    saves = [
        float(e.get("blocking_s") or 0) + float(e.get("background_commit_s") or 0)
        for e in read_jsonl(run_dir / EVENTS)
        if e.get("kind") == "checkpoint_saved"
    ]
    return max([STOP_GRACE_S, *(3 * s for s in saves)])


class _Stop:
    """The launcher's signals, from the start of launch_local to its end.

    SIGTERM (a scheduler's, or `kill`, to the launcher alone or to its process group) is handled here, not by
    torch's agent. The agent's own handling stops the workers with SIGTERM and waits for them to exit; but a worker
    that saved and returned waits in turn for the agent to read its return value, which the agent does not do while
    it closes, so every such stop ended in SIGKILL after the agent's 30 s and a SignalException traceback (issue 21).
    Here the SIGTERM goes on to the workers over their lifelines, the agent keeps watching them, and they end as at
    the end of training: every rank stops after the same step, saves it and exits 0, and so does the launcher.
    Workers still stopping after stop_grace() seconds are killed (their save is then not committed, and the newest
    committed checkpoint stands).

    A first Ctrl-C (the terminal sends it to the whole group; the workers ignore theirs) stops the same way and ends
    with 130, as without --nproc; a second one kills the workers at once (their save in flight is not committed).
    SIGHUP and SIGQUIT stay torch's: its agent passes them on to the workers, waits for them (its shutdown timeout,
    then SIGKILL) and raises SignalException, which exit_code turns into the status."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.requested = False
        self.interrupted = False  # the stop is a Ctrl-C's: the launcher ends with 130
        self.grace = STOP_GRACE_S
        self._lifelines: Lifelines | None = None
        self._saved: dict[int, object] = {}

    def __enter__(self) -> _Stop:
        for sig in (
            signal.SIGTERM,
            signal.SIGINT,
            signal.SIGALRM,
            *(getattr(signal, s) for s in TORCH_SIGNALS.split(",")),
        ):
            self._saved[sig] = signal.getsignal(sig)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in self._saved.items():  # torch's agent leaves its handlers in place
            if handler is not None:
                signal.signal(sig, handler)

    def attach(self, lifelines: Lifelines | None) -> None:
        """The running attempt's lifelines (None between attempts); a SIGTERM that came first is passed on now."""
        self._lifelines = lifelines
        if lifelines is not None and self.requested:
            lifelines.stop()

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        # Passed on once: a second one could reach a worker whose Preemption handler is gone, on its way out.
        if self.requested:
            return
        self.requested = True
        self.grace = stop_grace(self.run_dir)
        if not self.interrupted:
            log.warning(
                "SIGTERM: the workers stop after the same step and save it (given %.0f s)", self.grace
            )
        if self._lifelines is not None:
            self._lifelines.stop()
        signal.signal(signal.SIGALRM, self._on_overdue)
        signal.setitimer(signal.ITIMER_REAL, self.grace)

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if self.interrupted:  # a second Ctrl-C: at once, unsaved (the agent kills the workers)
            raise SignalException("Ctrl-C twice", signal.SIGKILL)
        self.interrupted = True
        log.warning("Ctrl-C: the workers stop after the same step and save it (Ctrl-C again to stop at once)")
        self._on_sigterm(signum, frame)

    def _on_overdue(self, signum: int, frame: FrameType | None) -> None:
        # Raised where the agent waits for its workers: it kills them at once (the sigval) and raises it again.
        raise SignalException(f"the workers had not stopped {self.grace:.0f} s after SIGTERM", signal.SIGKILL)

    def stopped_code(self) -> int:
        """The status of a stop the workers completed: 130 for a Ctrl-C (as without --nproc), 0 for SIGTERM."""
        if self.interrupted:
            print("\ninterrupted (Ctrl-C): the workers stopped after a step and saved it", file=sys.stderr)
            return INTERRUPTED_EXIT_CODE
        return 0

    def exit_code(self, e: SignalException, logs: Path) -> int:
        if e.sigval == signal.SIGKILL and self.interrupted and str(e) == "Ctrl-C twice":
            raise KeyboardInterrupt from None  # report_errors: the "interrupted" line and 130, as without --nproc
        if e.sigval == signal.SIGKILL:  # _on_overdue
            print(
                f"error: {e}: killed them; the newest committed checkpoint stands. Logs: {logs}",
                file=sys.stderr,
            )
            return 1
        print(f"stopped by {e.sigval.name}", file=sys.stderr)
        return 128 + int(e.sigval)


def _start_fork_server() -> None:
    """Start the fork server the workers are forked from (if it is not running), with SIGTERM ignored: a SIGTERM to
    the process group must stop the workers after their save, not kill the process that reports their exit statuses
    to the agent (its death reads as every worker failing with status 255 while they save). An ignored signal stays
    ignored across fork and exec; it is blocked meanwhile, so that one sent in that instant reaches the launcher
    afterwards instead of being lost (multiprocessing's resource tracker does the same). The workers take SIGTERM
    back in worker_main."""
    # Set before the fork server starts, which then keeps these imported for every restart (this module imports the
    # trainer). torch._dynamo too: every worker's optimizer imports it (torch.optim's add_param_group), 0.33 s once here
    # rather than in each worker.
    multiprocessing.set_forkserver_preload(["scaletrain.launch", "torch._dynamo"])
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _start_log_dir(run_dir: Path) -> Path:
    """<run dir>/logs/start-N, N counting this run's starts from 1: each start's attempts log into folders of their
    own (logs/start-N/attempt-A/rank-R.stderr.log), never over an earlier start's."""
    logs = run_dir / LOGS
    logs.mkdir(parents=True, exist_ok=True)
    n = 1 + max((int(m[1]) for p in logs.iterdir() if (m := re.fullmatch(r"start-(\d+)", p.name))), default=0)
    while True:
        try:
            (logs / f"start-{n}").mkdir()
            return logs / f"start-{n}"
        except FileExistsError:  # taken since the listing
            n += 1


class _RankLogs(LogsSpecs):
    """One attempt's worker logs side by side in its folder: rank-R.stdout.log, rank-R.stderr.log and, when a
    worker records its exception, rank-R.error.json (torch's default nests them as <run id>/attempt_0/R/stdout.log).
    Both streams are shown on the console too, each line prefixed [defaultR]:. R is the local rank, which is the
    rank under --nproc (one node)."""

    def __init__(self, log_dir: Path) -> None:
        super().__init__(str(log_dir), redirects=Std.ALL, tee=Std.ALL)

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        folder = Path(self.root_log_dir)
        folder.mkdir(parents=True, exist_ok=True)
        out, err, error = ({r: str(folder / f"rank-{r}.{name}") for r in envs} for name in _LOG_NAMES)
        for r, env in envs.items():
            env["TORCHELASTIC_ERROR_FILE"] = error[r]
        return LogsDest(stdouts=out, stderrs=err, tee_stdouts=out, tee_stderrs=err, error_files=error)


_LOG_NAMES = ("stdout.log", "stderr.log", "error.json")


LOCAL_RDZV = "scaletrain-local"


def bound_store(host: str = "127.0.0.1") -> TCPStore:
    """A TCPStore server listening on `host` only (loopback: reachable from this machine only). Given any host, even
    "localhost", a TCPStore server listens on every interface ([::], torch 2.13), so it is handed a socket already
    bound to `host`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    # detach(): the store's libuv server owns and closes the descriptor from now on.
    return TCPStore(
        host, port, is_master=True, multi_tenant=True, use_libuv=True, master_listen_fd=sock.detach()
    )


class _LocalBackend(C10dRendezvousBackend):
    @property
    def name(self) -> str:  # the handler reports it, and torch checks it against the name asked for
        return LOCAL_RDZV


def _local_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """torch's c10d rendezvous handler for one node, with both of its store servers (the rendezvous store and the
    one shared with the workers) on the endpoint's host only: loopback, or a replica group's cluster address."""
    host = params.endpoint.rsplit(":", 1)[0].strip("[]")
    store = bound_store(host)
    handler = create_handler(store, _LocalBackend(store, params.run_id), params)
    # torch binds this one to [::] too
    handler._create_tcp_store_server = lambda addr, port: bound_store(host)
    return handler


rendezvous_handler_registry.register(LOCAL_RDZV, _local_handler)


def _run_workers(nproc: int, log_dir: Path, worker_args: list[str], stop: _Stop | None = None,
                 host: str = "127.0.0.1") -> None:  # fmt: skip
    """One attempt: what `torchrun --standalone --nproc-per-node N -m scaletrain train ARGS` does, except that the
    workers are forked from a fork server that has already imported torch and scaletrain (_start_fork_server; a fresh
    interpreter spends ~3 s on imports on this CPU: most of a restart's cost, paid again on every restart without
    it), that each gets a lifeline to the launcher (SIGTERM passed on, death with the launcher), and that their
    logs lie flat (_RankLogs)."""
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        role="default",
        # As torchrun --standalone (a private c10d rendezvous on a free port), but listening on `host` only (loopback,
        # or a replica group's cluster address); local_addr makes it the workers' MASTER_ADDR too. Multi-node runs
        # use torchrun's own flags.
        rdzv_backend=LOCAL_RDZV,
        rdzv_endpoint=f"{host}:0",
        local_addr=host,
        max_restarts=0,  # launch_local restarts, after its diagnosis
        monitor_interval=0.1,
        start_method="forkserver",
        logs_specs=_RankLogs(log_dir),
        signals_to_handle=TORCH_SIGNALS,  # not SIGTERM: the launcher's own (_Stop)
    )
    lifelines = Lifelines(nproc)
    try:
        if stop is not None:
            stop.attach(lifelines)
        # The fork server finds worker_main by reference (module and name): it must stay a module-level function.
        elastic_launch(config, worker_main)(lifelines.readers, *worker_args)
    finally:
        if stop is not None:
            stop.attach(None)
        lifelines.close()


def _diagnose(e: ChildFailedError, log_dir: Path) -> tuple[Diagnosis, int]:
    """Classify every failed rank from its exit status and the end of its log; return the root cause's
    (diagnosis, rank)."""
    found = []
    for rank, failure in e.failures.items():
        text = tail(log_dir / f"rank-{failure.local_rank}.stderr.log", 60)  # _RankLogs; "" when there is none
        if failure.error_file:
            text += "\n" + read_error_file(failure.error_file)
        code = failure.exitcode
        found.append(
            (failure.timestamp, rank, classify(code, -code if code is not None and code < 0 else None, text))
        )
    rank, diag = root_cause(found)
    return diag, rank
