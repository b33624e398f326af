"""The run directory: resolved on rank 0 (a default one carries a timestamp), created, its config.toml written, and
the run's id (made when the directory is first used, the same for every restart) shared with every rank."""

from __future__ import annotations

import uuid
from pathlib import Path

import torch.distributed as dist

from scaletrain.config import Config
from scaletrain.config_io import default_run_dir, to_dict, write_toml
from scaletrain.parallel.mesh import broadcast_object


def open_run_dir(cfg: Config, is_main: bool, group: dist.ProcessGroup | None) -> tuple[Path, str]:
    """Return the run directory and the run id; `group` is the CPU control group (None on one process)."""
    if not cfg.run.name:
        cfg.run.name = "run"
    if not cfg.run.dir:
        cfg.run.dir = str(broadcast_object(default_run_dir(cfg.run.name), group))
    run_dir = Path(cfg.run.dir)
    run_id = None
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_toml(to_dict(cfg), run_dir / "config.toml")
        id_file = run_dir / "run_id"
        if not id_file.exists():
            id_file.write_text(uuid.uuid4().hex + "\n")
        run_id = id_file.read_text().strip()
    return run_dir, broadcast_object(run_id, group)
