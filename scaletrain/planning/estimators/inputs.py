"""The planner's inputs: a config read without validation (the planner checks the layout itself, and plans for
devices that are not this machine's) and the model shape it resolves to."""

from __future__ import annotations

from scaletrain.config import Config
from scaletrain.config.io import parse_config
from scaletrain.data import load_tokenizer
from scaletrain.errors import ConfigError, UserError
from scaletrain.models.llama import ModelArgs
from scaletrain.models.presets import PRESETS, resolve_model_args


def parse_unvalidated(path: str | None, overrides: list[str]) -> Config:
    """The config with its overrides and types checked, not validated (the planner checks the layout itself, and
    plans for a device that is not this one)."""
    cfg, problems = parse_config(path, overrides)
    if problems:
        raise ConfigError(problems)
    return cfg


def model_args(cfg: Config) -> ModelArgs:
    if cfg.model.preset not in PRESETS:
        raise ConfigError(f"model.preset '{cfg.model.preset}' is unknown; choose one of {', '.join(PRESETS)}")
    try:
        vocab = load_tokenizer(cfg.data.tokenizer).vocab_size
    except UserError:
        vocab = None
    return resolve_model_args(cfg.model, vocab, cfg.data.seq_len, moe=cfg.moe)
