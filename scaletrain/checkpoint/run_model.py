"""The whole model of a finished or running training run, read on one process from its newest intact checkpoint (DCP
reshards whatever parallel layout saved it) with the run's config and tokenizer: what `convert`, `parity`,
`generate` and `eval` load."""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

import fsspec
import torch.distributed.checkpoint as dcp

from scaletrain.checkpoint.integrity import COMMIT, newest_intact, step_path, verify
from scaletrain.checkpoint.safe_load import make_reader
from scaletrain.checkpoint.state import ModelState
from scaletrain.config import Config, translate_renamed
from scaletrain.config_io import read_toml, to_dataclass
from scaletrain.data import Tokenizer, load_tokenizer
from scaletrain.errors import ConfigError, UserError
from scaletrain.models import Transformer, build_meta_model, resolve_model_args
from scaletrain.rundir import CONFIG, RunDir, absolute

log = logging.getLogger("scaletrain")
_STEP_DIR = re.compile(r"step-\d+")


def is_checkpoint_dir(path: Path) -> bool:
    """A run's checkpoint directory (`checkpoints/step-N`), committed or not, rather than a run directory."""
    if (path / COMMIT).exists():
        return True
    return bool(_STEP_DIR.fullmatch(path.name)) and path.is_dir() and not (path / CONFIG).exists()


def newest_intact_path(ckpt_root: str) -> str:
    """The newest intact checkpoint under a run's checkpoint root (a folder or an fsspec URL)."""
    step, failed = newest_intact(fsspec.core.url_to_fs(ckpt_root)[0], ckpt_root)
    reasons = [f"step-{s:08d}: {reason}" for s, reason, _ in failed]
    if step is None:
        because = f" ({'; '.join(reasons)})" if reasons else ""
        raise UserError(f"no committed, intact checkpoint under {ckpt_root}{because}")
    for reason in reasons:
        log.warning("skipping %s", reason)
    return step_path(ckpt_root, step)


def run_config(run_dir: Path) -> Config:
    """The config.toml saved in `run_dir`, typed but not validated (an older run's renamed keys translated)."""
    cfg, problems = to_dataclass(Config, translate_renamed(read_toml(str(run_dir / CONFIG))))
    if problems:
        raise ConfigError(problems)
    return cfg


def load_run_model(src: Path) -> tuple[Transformer, Config, Tokenizer, str]:
    """The model of a run directory (or one of its checkpoint directories), on CPU in fp32, with the weights of
    the newest intact checkpoint; also the run's config, its tokenizer and the checkpoint read. A checkpoint
    directory given by itself is verified as the newest is (every file against its checksum)."""
    src = absolute(src)
    given = is_checkpoint_dir(src)
    run_dir = src.parent.parent if given else src
    if given:
        reason = verify(fsspec.filesystem("file"), str(src))
        if reason is not None:
            raise UserError(
                f"{src} is not an intact checkpoint: {reason}; give the run directory (its newest intact "
                "checkpoint is read) or another checkpoints/step-N directory"
            )
    if not (run_dir / CONFIG).is_file():
        raise UserError(f"{run_dir} has no {CONFIG}; give a run directory or a checkpoint inside one")
    cfg = run_config(run_dir)
    ckpt = str(src) if given else newest_intact_path(RunDir(run_dir).checkpoint_root(cfg.checkpoint))
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    model = build_meta_model(
        resolve_model_args(cfg.model, tokenizer.vocab_size, cfg.data.seq_len, moe=cfg.moe)
    )
    model.to_empty(device="cpu")
    model.init_weights()
    with warnings.catch_warnings():
        # DCP's note that it loads on one process ("torch.distributed is disabled ..."): what is meant here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load({"model": ModelState([model])}, storage_reader=make_reader(str(ckpt)), no_dist=True)
    return model, cfg, tokenizer, ckpt
