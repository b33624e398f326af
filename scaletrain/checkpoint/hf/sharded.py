"""Hugging Face import into an already parallelised model (issue 23 item 3): each rank reads from the safetensors
files only the rows and columns its own parameters hold (safe_open's lazy slices), so no rank holds a full copy of
the model at any time. Names and layouts are the family adapters' (families.py); the values loaded equal
load_hf_weights' on the whole model bit for bit (tests/distributed/test_hf_sharded.py)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn.parallel import DistributedDataParallel as DDP

from scaletrain.checkpoint.hf.families import adapter, import_problems
from scaletrain.checkpoint.hf.files import Source, few, hf_tensor_files, read_hf_config
from scaletrain.errors import ConfigError, UserError
from scaletrain.models.llama import ModelArgs, Transformer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Target:
    """One entry of a part's state dict: the tensor this rank writes (a DTensor's local shard, or the whole plain
    tensor), the global shape, and where the local block starts in it."""

    local: torch.Tensor
    shape: tuple[int, ...]
    offset: tuple[int, ...]


def _targets(part: nn.Module) -> dict[str, _Target]:
    """Every state-dict entry of one model part (a whole model, DDP's wrapped module, or a pipeline stage) under
    the unwrapped model's names. Compile and recompute keep the names (parallel/compile.py, recompute.py)."""
    module = part.module if isinstance(part, DDP) else part
    out = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if isinstance(t, DTensor):
            shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            local = t.to_local()
            assert tuple(local.shape) == tuple(shape), f"{name}: local {tuple(local.shape)} vs {shape}"
            out[name] = _Target(local, tuple(t.shape), tuple(offset))
        else:
            out[name] = _Target(t, tuple(t.shape), (0,) * t.dim())
    return out


def _check_shapes(name: str, target: _Target, src: Source, shapes: dict[str, list[int]]) -> None:
    """UserError when the HF tensors behind `name` do not have its global shape."""
    names, chunk = src.names, src.chunk
    if not names:
        return
    if src.transform is not None:
        meta = torch.empty(shapes[names[0]], device="meta")
        got = tuple(src.transform(meta).shape)
    elif len(names) > 1:  # one per expert, stacked on a new dim 0
        got = (len(names), *shapes[names[0]]) if all(shapes[n] == shapes[names[0]] for n in names) else None
    else:
        got = tuple(shapes[names[0]])
        if chunk >= 0 and len(got) == 3 and got[1] % 2 == 0:
            got = (got[0], got[1] // 2, got[2])  # one half of the fused gate_up_proj
    if got != target.shape:
        raise UserError(
            f"{name}: shape {got} in the checkpoint ({names[0]}), {target.shape} in the model "
            "(does the config match config.json?)"
        )


def _read(handles: dict[str, object], target: _Target, src: Source) -> torch.Tensor:
    """This rank's block of one of our tensors, read from the HF tensors the source names (files.Source)."""
    names, chunk = src.names, src.chunk
    region = [slice(o, o + n) for o, n in zip(target.offset, target.local.shape, strict=True)]
    if not names:
        return torch.zeros(target.local.shape)
    if src.transform is not None:
        hf = handles[names[0]]
        if src.rows:
            return src.transform(hf.get_slice(names[0])[region[0]])[(slice(None), *region[1:])]
        return src.transform(hf.get_tensor(names[0]))[tuple(region)]
    if len(names) > 1:
        experts = names[region[0]]
        if not experts:
            return torch.empty(target.local.shape)
        return torch.stack([handles[n].get_slice(n)[tuple(region[1:])] for n in experts])
    if chunk >= 0:
        half = target.shape[1]
        region[1] = slice(region[1].start + chunk * half, region[1].stop + chunk * half)
    return handles[names[0]].get_slice(names[0])[tuple(region)]


def load_hf_sharded(parts: list[nn.Module], path: Path, args: ModelArgs) -> int:
    """Copy HF weights into this rank's parameters and buffers of an already parallelised (and materialised)
    model: `parts` as ParallelModel.parts (a pipeline rank's stages hold only their layers). DTensor shards (FSDP2,
    TP, EP and their products) get the block their local shard covers, plain tensors (one process, DDP) the whole
    tensor. No collectives. ConfigError naming every field and tensor that would not load as saved (as
    load_hf_weights), UserError for what this rank's parameters miss. Returns the bytes of the blocks this rank copied
    (the loader's own count; the pages the kernel mapped are measured in tests/distributed/test_hf_sharded.py)."""
    files = hf_tensor_files(path)
    problems = import_problems(args, read_hf_config(path), list(files))
    if problems:
        raise ConfigError([f"{path}: {p}" for p in problems])
    targets: dict[str, _Target] = {}
    for part in parts:
        targets |= _targets(part)
    family = adapter(args.family)
    sources = {name: family.import_source(args, name, set(files)) for name in targets}
    missing = sorted({n for src in sources.values() for n in src.names if n not in files})
    if missing:
        raise UserError(f"the Hugging Face {family.NAME} checkpoint lacks {few(missing)}")
    read = 0
    with contextlib.ExitStack() as stack:
        needed = sorted({files[n] for src in sources.values() for n in src.names})
        opened = {f: stack.enter_context(safe_open(str(f), framework="pt")) for f in needed}
        handles = {n: opened[f] for n, f in files.items() if f in opened}
        shapes = {n: handles[n].get_slice(n).get_shape() for src in sources.values() for n in src.names}
        for name, src in sources.items():
            _check_shapes(name, targets[name], src, shapes)
        with torch.no_grad():
            for name, src in sources.items():
                block = _read(handles, targets[name], src)
                targets[name].local.copy_(block.to(targets[name].local.dtype))
                read += block.numel() * block.element_size()
    log.info("loaded %d tensors from %s: %.1f MB read by this rank", len(targets), path, read / 2**20)
    return read


def load_hf_weights(model: Transformer, path: Path) -> None:
    """Copy HF weights into an (already materialised, unsharded) model, checking config.json, names and shapes:
    ConfigError naming every field and tensor that would not load as saved: the per-rank import on one rank."""
    load_hf_sharded([model], path, model.args)
