"""`scaletrain train --nproc N`: start N local workers through torchrun's elastic agent.

The launcher validates the config, fixes the run directory and tokenises the data once, so that workers start
on a checked config and a warm data cache, and a bad input is reported before any worker starts.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from scaletrain.config import Config
from scaletrain.data import load_tokenizer, prepare_data
from scaletrain.resilience.watchdog import append_event

log = logging.getLogger("scaletrain")


def launch_local(cfg: Config, config_path: str | None, overrides: list[str], nproc: int, max_restarts: int) -> int:
    """Run the job, and when a worker fails: diagnose why, write it to events.jsonl, and restart the group (which
    resumes from the newest complete checkpoint) unless the cause is one a restart cannot cure."""
    from scaletrain.cli import default_run_dir
    from scaletrain.resilience.diagnose import RestartPolicy

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
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
        torchrun_args = get_args_parser().parse_args(
            ["--nproc-per-node", str(nproc), "--standalone", "--max-restarts", "0", "--log-dir", str(log_dir),
             "--redirects", "3", "--tee", "3", "--module", "scaletrain", "train", *worker_args])
        log.info("launching %d worker(s) (attempt %d); run directory %s", nproc, attempt, run_dir)
        try:
            run(torchrun_args)
            return 0
        except ChildFailedError as e:
            diag, rank = _diagnose(e)
        append_event(run_dir, "failure", diag.step, rank=rank, cause=diag.kind, detail=diag.detail,
                     attempt=attempt)
        restart, reason = policy.decide(diag)
        if not restart:
            append_event(run_dir, "stopped", diag.step, cause=diag.kind, reason=reason)
            print(f"error: rank {rank} failed ({diag.kind}: {diag.detail}); not restarting: {reason}. "
                  f"Logs: {log_dir}", file=sys.stderr)
            return 1
        attempt += 1
        append_event(run_dir, "restart", diag.step, attempt=attempt, cause=diag.kind, rank=rank)
        log.warning("rank %d failed (%s: %s); restart %d of %d", rank, diag.kind, diag.detail, attempt,
                    max_restarts)


def _diagnose(e: ChildFailedError):
    """Classify every failed rank from its exit status and the end of its log; return the root cause's
    (diagnosis, rank)."""
    from scaletrain.resilience.diagnose import classify, read_error_file, root_cause, tail

    found = []
    for rank, failure in e.failures.items():
        text = ""
        if failure.error_file:
            folder = Path(failure.error_file).parent
            text = tail(folder / "stderr.log", 60) + "\n" + read_error_file(failure.error_file)
        code = failure.exitcode
        found.append((failure.timestamp, rank, classify(code, -code if code is not None and code < 0 else None, text)))
    rank, diag = root_cause(found)
    return diag, rank
