"""`scaletrain train --nproc N`: start N local workers through torchrun's elastic agent.

The launcher validates the config, fixes the run directory and tokenises the data once, so that workers start
on a checked config and a warm data cache, and a bad input is reported before any worker starts.
"""

from __future__ import annotations

import logging
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from scaletrain.config import Config
from scaletrain.data import load_tokenizer, prepare_data

log = logging.getLogger("scaletrain")


def launch_local(cfg: Config, config_path: str | None, overrides: list[str], nproc: int) -> int:
    from scaletrain.cli import default_run_dir

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    run_dir = cfg.run.dir or default_run_dir(cfg)
    prepare_data(cfg.data, load_tokenizer(cfg.data.tokenizer), log=log.info)
    worker_args = (["--config", config_path] if config_path else []) + overrides + ["--run.dir", run_dir]
    if cfg.run.name:
        worker_args += ["--run.name", cfg.run.name]
    torchrun_args = get_args_parser().parse_args(
        ["--nproc-per-node", str(nproc), "--standalone", "--module", "scaletrain", "train", *worker_args])
    # Each worker sets its own thread count (training.threads); this only silences torchrun's OMP warning.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    log.info("launching %d workers; run directory %s", nproc, run_dir)
    try:
        run(torchrun_args)
    except ChildFailedError as e:
        failed = ", ".join(f"rank {r} (exit {f.exitcode})" for r, f in sorted(e.failures.items()))
        print(f"error: worker(s) failed: {failed}; see their messages above and {run_dir}", file=sys.stderr)
        return 1
    return 0
