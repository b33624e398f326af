"""Run training in this process, or start N local workers through torchrun's elastic agent (`--nproc N`).

The launcher validates the config, fixes the run directory and tokenises the data once, so that workers start
on a checked config and a warm data cache, and a bad input is reported before any worker starts. The worker
entry and its crash path live here too: the CLI calls into this module, never the other way round.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
import traceback
import uuid
from pathlib import Path

from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, create_handler
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, get_args_parser

from scaletrain.config import Config
from scaletrain.config_io import load_config
from scaletrain.data import load_tokenizer, prepare_data
from scaletrain.errors import STOPPED_EXIT_CODE, UserError, report_errors, run_exit_code
from scaletrain.metrics.writer import append_event
from scaletrain.resilience.diagnose import (
    Diagnosis,
    RestartPolicy,
    classify,
    read_error_file,
    root_cause,
    tail,
)
from scaletrain.resilience.timelimit import JOB_START_ENV
from scaletrain.train import train

log = logging.getLogger("scaletrain")

LINGER_S = 3.0  # many times the agent's monitor interval (0.1 s)


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
    launcher reads the stop back from events.jsonl (run_exit_code)."""
    try:
        stopped = train(cfg)["stopped"]
    except (UserError, KeyboardInterrupt):
        raise
    except BaseException:
        text = traceback.format_exc()
        sys.stderr.write(text)
        sys.stderr.flush()
        _linger_if_a_peer_failed(text)
        os._exit(1)
    return STOPPED_EXIT_CODE if stopped and not under_torchrun() else 0


def _linger_if_a_peer_failed(error: str) -> None:
    """A rank whose collective broke because a peer died waits before exiting, so that the agent, which reports
    the first worker it finds dead, finds the peer that failed (killed, out of memory) rather than this one. The
    agent ends the wait at once: it stops the other workers with SIGTERM as soon as it sees a failure."""
    if under_torchrun() and classify(1, None, error).kind == "collective_timeout":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the preemption handler: the agent's stop ends us
        time.sleep(LINGER_S)


def worker_main(config_path: str, *overrides: str) -> None:
    """A worker of launch_local, in a process forked from the warm fork server: load the config the launcher
    checked (the run directory is its own job's, so it is not checked again) and train."""
    install_stack_dump()
    sys.stdout.reconfigure(line_buffering=True)  # its stdout is a log file: keep lines up to a SIGKILL
    world = int(os.environ.get("WORLD_SIZE", "1"))

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
    resumes from the newest complete checkpoint) unless the cause is one a restart cannot cure."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"
    )
    run_dir = Path(cfg.run.dir)  # the CLI resolved it (scaletrain.rundir)
    prepare_data(cfg.data, load_tokenizer(cfg.data.tokenizer), log=log.info)
    worker_args = [*overrides, "--run.dir", str(run_dir)]
    if cfg.run.name:
        worker_args += ["--run.name", cfg.run.name]
    # Each worker sets its own thread count (training.threads); this only silences torchrun's OMP warning.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # run.time_limit counts from here for every attempt: the fork server, started below, hands it to the workers.
    os.environ.setdefault(JOB_START_ENV, f"{time.time():.3f}")
    run_dir.mkdir(parents=True, exist_ok=True)
    append_event(run_dir, "job_start", None, nproc=nproc, max_restarts=max_restarts)
    policy = RestartPolicy(max_restarts)
    attempt = 0
    while True:
        log_dir = run_dir / "logs" / f"attempt-{attempt}"
        log.info("launching %d worker(s) (attempt %d); run directory %s", nproc, attempt, run_dir)
        try:
            _run_workers(nproc, log_dir, [config_path or "", *worker_args])
            return run_exit_code(run_dir)  # 0, or STOPPED_EXIT_CODE when the workers stopped early
        except ChildFailedError as e:
            diag, rank = _diagnose(e, log_dir)
        append_event(
            run_dir, "failure", diag.step, rank=rank, cause=diag.kind, detail=diag.detail, attempt=attempt
        )
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


LOOPBACK_RDZV = "scaletrain-loopback"


def loopback_store() -> TCPStore:
    """A TCPStore server reachable from this machine only. Given any host, even "localhost", a TCPStore server
    listens on every interface ([::], torch 2.13), so it is handed a socket already bound to 127.0.0.1."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    # detach(): the store's libuv server owns and closes the descriptor from now on.
    return TCPStore(
        "127.0.0.1", port, is_master=True, multi_tenant=True, use_libuv=True, master_listen_fd=sock.detach()
    )


class _LoopbackBackend(C10dRendezvousBackend):
    @property
    def name(self) -> str:  # the handler reports it, and torch checks it against the name asked for
        return LOOPBACK_RDZV


def _loopback_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """torch's c10d rendezvous handler with both of its store servers (the rendezvous store and the one shared
    with the workers) on loopback."""
    store = loopback_store()
    handler = create_handler(store, _LoopbackBackend(store, params.run_id), params)
    handler._create_tcp_store_server = lambda addr, port: loopback_store()  # torch binds this one to [::] too
    return handler


rendezvous_handler_registry.register(LOOPBACK_RDZV, _loopback_handler)


def _run_workers(nproc: int, log_dir: Path, worker_args: list[str]) -> None:
    """One attempt: what `torchrun --standalone --nproc-per-node N -m scaletrain train ARGS` does, except that the
    workers are forked from a fork server that has already imported torch and scaletrain. A fresh interpreter
    spends ~3 s on imports on this CPU: most of a restart's cost, paid again on every restart without this."""
    args = get_args_parser().parse_args(
        [
            "--nproc-per-node",
            str(nproc),
            "--max-restarts",
            "0",
            "--log-dir",
            str(log_dir),
            "--redirects",
            "3",
            "--tee",
            "3",
            "--start-method",
            "forkserver",
            "--module",
            "scaletrain",
        ]
    )
    # "--module scaletrain" only satisfies the parser (it wants a script); the entrypoint is worker_main above,
    # which the fork server finds by reference (module and name), so it must stay a module-level function.
    # As torchrun --standalone (a private c10d rendezvous on a free port), but listening on loopback only;
    # local_addr makes the workers' MASTER_ADDR 127.0.0.1 too. Multi-node runs use torchrun's own flags.
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = LOOPBACK_RDZV, "127.0.0.1:0", str(uuid.uuid4())
    args.local_addr = "127.0.0.1"
    config, _, _ = config_from_args(args)
    # Set before the first launch starts the fork server, which then keeps these imported for every restart
    # (this module imports the trainer).
    multiprocessing.set_forkserver_preload(["scaletrain.launch"])
    elastic_launch(config, worker_main)(*worker_args)


def _diagnose(e: ChildFailedError, log_dir: Path) -> tuple[Diagnosis, int]:
    """Classify every failed rank from its exit status and the end of its log; return the root cause's
    (diagnosis, rank)."""
    found = []
    for rank, failure in e.failures.items():
        # The agent's log folder: <log_dir>/<run id>/attempt_0/<local rank>/ (error.json is only there when the
        # worker wrote one; a function worker's may be elsewhere).
        logs = sorted(log_dir.glob(f"*/attempt_*/{failure.local_rank}/stderr.log"))
        text = tail(logs[-1], 60) if logs else ""
        if failure.error_file:
            text += "\n" + read_error_file(failure.error_file)
        code = failure.exitcode
        found.append(
            (failure.timestamp, rank, classify(code, -code if code is not None and code < 0 else None, text))
        )
    rank, diag = root_cause(found)
    return diag, rank
