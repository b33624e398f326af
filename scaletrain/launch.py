"""`scaletrain train --nproc N`: start N local workers through torchrun's elastic agent.

The launcher validates the config, fixes the run directory and tokenises the data once, so that workers start
on a checked config and a warm data cache, and a bad input is reported before any worker starts.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, get_args_parser

from scaletrain.config import Config
from scaletrain.data import load_tokenizer, prepare_data
from scaletrain.resilience.watchdog import append_event

log = logging.getLogger("scaletrain")


def launch_local(
    cfg: Config, config_path: str | None, overrides: list[str], nproc: int, max_restarts: int
) -> int:
    """Run the job, and when a worker fails: diagnose why, write it to events.jsonl, and restart the group (which
    resumes from the newest complete checkpoint) unless the cause is one a restart cannot cure."""
    from scaletrain.cli import default_run_dir
    from scaletrain.resilience.diagnose import RestartPolicy

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"
    )
    run_dir = Path(cfg.run.dir or default_run_dir(cfg))
    prepare_data(cfg.data, load_tokenizer(cfg.data.tokenizer), log=log.info)
    worker_args = (["--config", config_path] if config_path else []) + overrides + ["--run.dir", str(run_dir)]
    if cfg.run.name:
        worker_args += ["--run.name", cfg.run.name]
    # Each worker sets its own thread count (training.threads); this only silences torchrun's OMP warning.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_dir.mkdir(parents=True, exist_ok=True)
    append_event(run_dir, "job_start", None, nproc=nproc, max_restarts=max_restarts)
    policy = RestartPolicy(max_restarts)
    attempt = 0
    while True:
        os.environ["SCALETRAIN_ATTEMPT"] = str(attempt)
        log_dir = run_dir / "logs" / f"attempt-{attempt}"
        log.info("launching %d worker(s) (attempt %d); run directory %s", nproc, attempt, run_dir)
        try:
            _run_workers(nproc, log_dir, worker_args)
            return 0
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
    # "--module scaletrain" only satisfies the parser (it wants a script); the entrypoint is worker_main below.
    # As torchrun --standalone: a private c10d rendezvous on a free local port.
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, _, _ = config_from_args(args)
    # Set before the first launch starts the fork server, which then keeps these imported for every restart.
    multiprocessing.set_forkserver_preload(["scaletrain.cli", "scaletrain.train"])
    elastic_launch(config, worker_main)(*worker_args)


def worker_main(*argv: str) -> None:
    """A worker process: `scaletrain train ARGV` in a process forked from the warm fork server."""
    from scaletrain.cli import main

    sys.stdout.reconfigure(line_buffering=True)  # its stdout is a log file: keep lines up to a SIGKILL
    code = main(["train", *argv])
    if code:
        sys.exit(code)


def _diagnose(e: ChildFailedError, log_dir: Path):
    """Classify every failed rank from its exit status and the end of its log; return the root cause's
    (diagnosis, rank)."""
    from scaletrain.resilience.diagnose import classify, read_error_file, root_cause, tail

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
