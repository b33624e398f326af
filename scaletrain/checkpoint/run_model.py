"""The whole model of a finished or running training run, read on one process from its newest intact checkpoint (DCP
reshards whatever parallel layout saved it) with the run's config and tokenizer: what `convert`, `parity`,
`generate` and `eval` load."""

from __future__ import annotations

import functools
import logging
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from scaletrain.checkpoint.integrity import COMMIT, newest_intact, step_path, verify
from scaletrain.checkpoint.safe_load import make_reader
from scaletrain.checkpoint.state import ModelState
from scaletrain.config import Config, translate_renamed
from scaletrain.config.io import absolute, read_toml, to_dataclass
from scaletrain.data import Tokenizer, load_tokenizer
from scaletrain.errors import ConfigError, UserError
from scaletrain.models import ModelArgs, Transformer, build_meta_model, resolve_model_args
from scaletrain.run.directory import CONFIG, RunDir

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


@dataclass
class RunCheckpoint:
    """A run's checkpoint, opened but not loaded: its config, tokenizer and model shape, and each model tensor on
    request (DCP reads only the chunks of that tensor), so a model larger than this host is read piece by piece."""

    cfg: Config
    tokenizer: Tokenizer
    path: str
    args: ModelArgs
    reader: FileSystemReader

    @functools.cached_property
    def metadata(self) -> Metadata:
        return self.reader.read_metadata()

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Our model's tensors in its state-dict order, with their shapes (from the checkpoint's metadata); a
        UserError when the checkpoint and the config's model disagree."""
        saved = {
            k.removeprefix("model."): tuple(m.size)
            for k, m in self.metadata.state_dict_metadata.items()
            if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
        }
        ours = {k: tuple(v.shape) for k, v in build_meta_model(self.args).state_dict().items()}
        if saved.keys() != ours.keys() or any(saved[k] != ours[k] for k in ours):
            differ = sorted(k for k in ours.keys() | saved.keys() if saved.get(k) != ours.get(k))
            raise UserError(
                f"{self.path} does not hold the model its run's config describes ({len(differ)} tensor(s) differ, "
                f"e.g. {differ[0]}: {saved.get(differ[0])} saved, {ours.get(differ[0])} configured)"
            )
        return ours

    def read(self, name: str) -> torch.Tensor:
        """One model tensor, whole, on CPU in the dtype it was saved in, whatever layout saved it."""
        meta = self.metadata.state_dict_metadata[f"model.{name}"]
        value = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        _dcp_load({"model": {name: value}}, self.reader)
        return value


def _dcp_load(state: dict, reader: FileSystemReader) -> None:
    with warnings.catch_warnings():
        # DCP's note that it loads on one process ("torch.distributed is disabled ..."): what is meant here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)


def open_run_checkpoint(src: Path) -> RunCheckpoint:
    """The newest intact checkpoint of a run directory (or the checkpoint directory `src`, verified as the newest
    is: every file against its checksum), with the run's config and tokenizer; no tensor is read."""
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
    args = resolve_model_args(cfg.model, tokenizer.vocab_size, cfg.data.seq_len, moe=cfg.moe)
    return RunCheckpoint(cfg, tokenizer, ckpt, args, make_reader(ckpt))


def load_run_model(
    src: Path, device: torch.device | str = "cpu"
) -> tuple[Transformer, Config, Tokenizer, str]:
    """The model of a run directory (or one of its checkpoint directories) in fp32 on `device`, with the weights
    of the newest intact checkpoint; also the run's config, its tokenizer and the checkpoint read. The model is
    materialised on `device` and DCP reads into it there, chunk by chunk: no full copy on the host first."""
    ckpt = open_run_checkpoint(src)
    model = build_meta_model(ckpt.args)
    model.to_empty(device=device)
    model.init_weights()  # the RoPE buffers (not saved); every saved tensor is read over its values
    _dcp_load({"model": ModelState([model])}, ckpt.reader)
    return model, ckpt.cfg, ckpt.tokenizer, ckpt.path


def read_data_position(src: Path) -> tuple[Config, dict[str, int | float], str]:
    """The data loader's position saved in the newest intact checkpoint of a run directory (or in the checkpoint
    directory `src`), with the run's config and the checkpoint read; no model tensor is read."""
    ckpt = open_run_checkpoint(src)
    saved = {
        k.removeprefix("data."): m
        for k, m in ckpt.metadata.state_dict_metadata.items()
        if k.startswith("data.")
    }
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in saved.items()}
    _dcp_load({"data": state}, ckpt.reader)
    return ckpt.cfg, {k: v.item() for k, v in state.items()}, ckpt.path
