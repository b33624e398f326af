"""The run directory: resolved on rank 0 (a default one carries a timestamp), created, its config.toml written (the
configs of earlier starts kept as config.<n>.toml), and the run's id (made when the directory is first used, the same for every restart) shared with every rank."""

from __future__ import annotations

import uuid
from pathlib import Path

import tomli_w
import torch.distributed as dist

from scaletrain.config import Config
from scaletrain.config_io import default_run_dir, read_toml, to_dict, tomllib, write_toml
from scaletrain.parallel.mesh import broadcast_object


def _keep_history(path: Path, resolved: dict) -> None:
    """Write the resolved config; a different one already there (an earlier start of this run, e.g. with another
    learning rate accepted) is kept as config.<n>.toml first, n = 1, 2, ... in the order of the starts."""
    if path.is_file() and read_toml(str(path)) != tomllib.loads(tomli_w.dumps(resolved)):
        n = 1
        while path.with_name(f"config.{n}.toml").exists():
            n += 1
        path.rename(path.with_name(f"config.{n}.toml"))
    write_toml(resolved, path)


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
        _keep_history(run_dir / "config.toml", to_dict(cfg))
        id_file = run_dir / "run_id"
        if not id_file.exists():
            id_file.write_text(uuid.uuid4().hex + "\n")
        run_id = id_file.read_text().strip()
    return run_dir, broadcast_object(run_id, group)
