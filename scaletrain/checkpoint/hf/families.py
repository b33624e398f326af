"""Which state-dict adapter converts a model family: `ADAPTERS`, from our model.family to the adapter module, and the
contract every adapter module fulfils (`Adapter`); and what would keep a checkpoint from loading as saved, whatever
its family (`import_problems`: config.json's own problems, model.* fields that differ from it, tensors the model
has no place for). core.py (export, checks) and sharded.py (every import) reach a family only through here; the
family's module holds its HF names, tensor reshapes and config.json fields, nothing else (torchtitan's
state_dict_adapter)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from scaletrain.checkpoint.hf import deepseek_v3, gpt_oss, llama, llama_family, qwen3
from scaletrain.checkpoint.hf.files import Source, few
from scaletrain.checkpoint.hf.mixtral import MOE_FIELDS as MOE_CONFIG_FIELDS

if TYPE_CHECKING:
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

    def export_tensors(
        self,
        args: ModelArgs,
        name: str,
        value: torch.Tensor,
        read: Callable[[str], torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The HF tensors of one of our state-dict entries (none: not exported, e.g. a tied output). `read` gives
        another of our entries, for an HF tensor made of two of ours (GPT-OSS's gate_up_proj from w1 and w3)."""

    def import_names(self, args: ModelArgs, names: set[str]) -> set[str]:
        """The HF tensor names a checkpoint of this shape holds (`names`: what it holds, for layout variants)."""

    def import_source(self, args: ModelArgs, name: str, names: set[str]) -> Source:
        """Where our entry `name` is read from, among the HF tensors `names`."""


ADAPTERS: dict[str, Adapter] = {
    "llama": llama_family,
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


def read_hf_config_fields(cfg: dict) -> tuple[dict, list[str]]:
    """(model.* fields, problems) of a config.json, by its family."""
    family = adapter_for_config(cfg)
    if family is None:
        return {}, [
            f"config.json has model_type '{cfg.get('model_type')}'; the model types that import are "
            f"{importable_types()}"
        ]
    return family.import_config(cfg)


def tensor_problems(names: list[str], args: ModelArgs, layers_from: str) -> list[str]:
    """What in a checkpoint's tensor names a model of `args` has no place for: biases, layers at or beyond its
    n_layers (`layers_from` names where that count comes from), experts at or beyond its n_experts, anything else
    unexpected. Dropping them would load a different model than the one saved."""
    family = adapter(args.family)
    expected = family.import_names(args, set(names))
    extra = [n for n in names if n not in expected and "rotary_emb" not in n]  # old HF saved RoPE's inv_freq
    biases = [n for n in extra if n.endswith(".bias")]
    beyond = [
        n
        for n in extra
        if n not in biases and (m := llama.LAYER.fullmatch(n)) and int(m["i"]) >= args.n_layers
    ]
    experts = [
        n
        for n in extra
        if n not in beyond and (m := _EXPERT.search(n)) and int(m["e"]) >= args.n_experts and args.n_experts
    ]
    other = [n for n in extra if n not in biases and n not in beyond and n not in experts]
    problems = []
    if biases:
        problems.append(
            f"{len(biases)} bias tensor(s) in the weights, e.g. {few(biases)}; our {family.NAME} has no biases"
        )
    if beyond:
        layers = sorted({int(llama.LAYER.fullmatch(n)["i"]) for n in beyond})
        problems.append(
            f"tensor(s) of layer {', '.join(map(str, layers))}, beyond {layers_from} {args.n_layers}: "
            f"{few(beyond)}; they would be dropped"
        )
    if experts:
        problems.append(
            f"tensor(s) of experts beyond the model's {args.n_experts} experts: {few(experts)}; they would be "
            "dropped"
        )
    if other:
        problems.append(
            f"unexpected tensor(s) {few([repr(n) for n in other])}: not weights of a "
            f"{family.architecture(args).removesuffix('ForCausalLM')} causal LM"
        )
    return problems


# An expert's own tensor in the Hub layout, whatever the family (experts.{e}.<name>).
_EXPERT = re.compile(r"\.experts\.(?P<e>\d+)\.")


_SHAPE_FIELDS = {"dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size"}
_TRAINING_CHOICES = {"capacity_factor", "aux_loss_coef", "z_loss_coef"}


def _args_problems(args: ModelArgs, hf: dict) -> list[str]:
    """model.* fields that differ from what config.json says the weights were trained with: same shapes, other
    numbers (e.g. the 8B preset's Llama 3.1 RoPE scaling on Llama 3 weights, which have none)."""
    # Every field config.json states but the shape (the tensors' shapes check it) and the MoE's training choices
    # (capacity and the balance losses, left to the config); a dense config.json states n_experts 0.
    hf = {"n_experts": 0, **hf}
    keys = [k for k in hf if k not in _SHAPE_FIELDS | _TRAINING_CHOICES]
    names = {k: f"moe.{MOE_CONFIG_FIELDS[k]}" if k in MOE_CONFIG_FIELDS else f"model.{k}" for k in keys}
    return [
        f"{names[k]} is {getattr(args, k)!r} but config.json has {hf[k]!r}; set {names[k]} = {hf[k]!r} (as "
        "`scaletrain convert --from hf` writes it)"
        for k in keys
        if k in hf and getattr(args, k) != hf[k]
    ]


def import_problems(args: ModelArgs, cfg: dict, names: list[str]) -> list[str]:
    """Why an HF checkpoint (its config.json and tensor names) would not load into a model of `args` as saved:
    config.json's own problems, model.* fields that differ from it, tensors the model has no place for."""
    fields, problems = read_hf_config_fields(cfg)
    problems += _args_problems(args, fields)
    return problems + tensor_problems(names, args, "model.n_layers")
