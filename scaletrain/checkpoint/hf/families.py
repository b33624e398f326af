"""Which state-dict adapter converts a model family: `ADAPTERS`, from our model.family to the adapter module, and the
contract every adapter module fulfils (`Adapter`). core.py (export, whole-model import, checks) and sharded.py
(per-rank import) reach a family only through here; the family's module holds its HF names, tensor reshapes and
config.json fields, nothing else (torchtitan's state_dict_adapter)."""

from __future__ import annotations

from typing import Protocol

import torch

from scaletrain.checkpoint.hf import deepseek_v3, gpt_oss, llama, qwen3
from scaletrain.checkpoint.hf.files import Source
from scaletrain.models.llama import ModelArgs


class Adapter(Protocol):
    """What a family's module (checkpoint/hf/<family>.py) provides, module-level."""

    NAME: str  # in messages: "Llama", "Qwen3", ...
    MODEL_TYPES: tuple[str, ...]  # config.json model_type values it imports

    def architecture(self, args: ModelArgs) -> str:
        """The transformers class an export loads into (may depend on args, e.g. MoE or not)."""

    def export_config(self, args: ModelArgs, eod_id: int | None) -> dict:
        """config.json of an export."""

    def import_config(self, cfg: dict) -> tuple[dict, list[str]]:
        """(every ModelArgs field but max_seq_len, family included; problems) of a config.json: a problem for
        each thing our model would compute differently."""

    def export_problems(self, args: ModelArgs, buffers: dict[str, torch.Tensor]) -> list[str]:
        """Why an export would not load as this model in transformers (buffers: the routing biases)."""

    def export_tensors(self, args: ModelArgs, name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        """The HF tensors of one of our state-dict entries (none: not exported, e.g. a tied output)."""

    def import_names(self, args: ModelArgs, names: set[str]) -> set[str]:
        """The HF tensor names a checkpoint of this shape holds (`names`: what it holds, for layout variants)."""

    def import_source(self, args: ModelArgs, name: str, names: set[str]) -> Source:
        """Where our entry `name` is read from, among the HF tensors `names`."""


ADAPTERS: dict[str, Adapter] = {
    "llama": llama,
    "qwen3": qwen3,
    "deepseek_v3": deepseek_v3,
    "gpt_oss": gpt_oss,
}  # type: ignore[dict-item]


def adapter(family: str) -> Adapter:
    if family not in ADAPTERS:
        raise ValueError(f"model.family {family!r} has no Hugging Face adapter; choose {', '.join(ADAPTERS)}")
    return ADAPTERS[family]


def adapter_for_config(cfg: dict) -> Adapter | None:
    """The adapter that imports a config.json, by its model_type; None when no family does."""
    kind = cfg.get("model_type")
    return next((a for a in ADAPTERS.values() if kind in a.MODEL_TYPES), None)


def importable_types() -> str:
    return ", ".join(t for a in ADAPTERS.values() for t in a.MODEL_TYPES)
