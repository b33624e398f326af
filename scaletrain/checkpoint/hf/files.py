"""A Hugging Face model directory on disk, whatever the family: its safetensors files (one, or several with
model.safetensors.index.json) read and written a tensor at a time, config.json and the tokenizer files beside them.
Nothing here knows a model: the names and shapes are the family adapters' (llama.py, mixtral.py), the flow core.py's.
Reads safetensors only (never pickles)."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from scaletrain.errors import UserError


@dataclass(frozen=True)
class Source:
    """Where one of our state-dict entries is read from in an HF checkpoint, without reading it.

    names: the HF tensors; several are stacked on a new dim 0 (one per expert); none gives zeros.
    chunk: 0 or 1 takes that half of dim 1 of the one tensor (a fused gate_up_proj: w1 then w3); -1 the whole.
    transform: makes our layout of the one tensor (e.g. GPT-OSS's interleaved, transposed gate_up_proj); the
    rank's region is cut out after it. rows: the transform keeps dim 0 (the experts), so only the rows of dim 0 a
    rank needs are read (whole on the other dims); else the whole tensor is read (small ones only)."""

    names: list[str]
    chunk: int = -1
    transform: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)
    rows: bool = True


FEW = 3  # tensor names shown in a message; the rest are counted


def few(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:FEW])
    return shown + (f" ({len(names)} in all)" if len(names) > FEW else "")


def umask_permissions(out: Path) -> None:
    """Give every file in `out` the mode a plain open() gives (0644 under the usual umask 022): safetensors writes
    0600, which another user, or a serving container under another uid, cannot read."""
    mask = os.umask(0)
    os.umask(mask)
    for f in out.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~mask)


def tokenizer_config(eod_token: str, max_len: int) -> dict:
    """tokenizer_config.json beside a copied tokenizer.json, so that transformers.AutoTokenizer knows its special
    tokens (without it eos_token is None). Our end-of-document token is both: packing puts it between documents,
    so it ends one and opens the next (GPT-2's convention for <|endoftext|>)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eod_token,
        "bos_token": eod_token,
        "model_max_length": max_len,
        "add_bos_token": False,  # documents are not prefixed at training: encode() adds no special tokens
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }


# HF's save_pretrained default (max_shard_size "5GB"): safetensors files of at most this many bytes each.
SHARD_BYTES = 5 * 10**9

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16"}


def plan_shards(
    tensors: list[tuple[str, tuple[int, ...]]], itemsize: int, max_bytes: int
) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """File name -> the tensors it holds, in order; a file is closed before it would pass `max_bytes` (a tensor
    larger than that gets a file of its own, as in transformers)."""
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * itemsize
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    n = len(groups)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}


class SafetensorsWriter:
    """One safetensors file written a tensor at a time: the header (every name, dtype, shape and offset) is known
    from the plan, so each tensor's bytes go straight to the file after it and nothing is held
    (https://github.com/huggingface/safetensors#format: a u64 header length, the JSON header padded to 8 bytes,
    then the data, C order, little-endian)."""

    def __init__(self, path: Path, entries: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype):
        self.entries, self.dtype, self.written = entries, dtype, 0
        header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape in entries:
            end = offset + math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, end]}
            offset = end
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.f = open(path, "wb")  # noqa: SIM115  # closed by close(), after the last of its tensors
        self.f.write(struct.pack("<Q", len(raw)) + raw)

    def done(self) -> bool:
        return self.written == len(self.entries)

    def write(self, name: str, value: torch.Tensor) -> None:
        expected, shape = self.entries[self.written]
        assert (name, tuple(value.shape), value.dtype) == (expected, shape, self.dtype), (name, expected)
        if value.numel():
            # Bytes in place (a uint8 view through numpy), little-endian as torch stores them on every host we run.
            self.f.write(value.contiguous().view(torch.uint8).reshape(-1).numpy().data)
        self.written += 1

    def close(self) -> None:
        assert self.done(), f"{self.f.name}: {self.written} of {len(self.entries)} tensors written"
        self.f.close()


INDEX_FILE = "model.safetensors.index.json"
"""Hugging Face's map of a multi-file checkpoint: {"metadata": {...}, "weight_map": {tensor name: file name}}."""


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of an HF directory (those its index names, when it has one); UserError when
    config.json or the weights are missing (pickle files are never loaded)."""
    if not (path / "config.json").is_file():
        raise UserError(f"{path} has no config.json; give a Hugging Face Llama model directory")
    if (path / INDEX_FILE).is_file():
        return sorted({path / f for f in _index_map(path).values()})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = (
            f" ({', '.join(pickled)} are pickle files, which are never loaded: convert them to safetensors)"
            if pickled
            else ""
        )
        raise UserError(f"{path} has no .safetensors weights{hint}")
    return files


def _index_map(path: Path) -> dict[str, str]:
    """The weight_map of `path`'s index, each file checked to be a plain name of a file in `path`."""
    index = path / INDEX_FILE
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{index} is not a safetensors index (no weight_map: {e})") from None
    for name, file in weight_map.items():
        if Path(file).name != file or not file.endswith(".safetensors"):
            raise UserError(f"{index} maps {name!r} to {file!r}, not a .safetensors file beside the index")
        if not (path / file).is_file():
            raise UserError(f"{index} maps {name!r} to {file}, which is not in {path}")
    return weight_map


def hf_tensor_files(path: Path) -> dict[str, Path]:
    """Which safetensors file holds each tensor of an HF directory: the index's weight_map for a multi-file
    checkpoint, each file's header otherwise (no tensor data is read). Every tensor is checked to be in the
    file that names it; UserError when the index and the files disagree or two files hold the same tensor.
    One reader of the layout for every import (whole, per-rank slices) and for `hf_dir_problems`."""
    indexed = _index_map(path) if (path / INDEX_FILE).is_file() else None
    where: dict[str, Path] = {}
    for f in weight_files(path):
        with safe_open(str(f), framework="pt") as st:  # reads the header only
            for name in st.keys():  # noqa: SIM118  # safe_open has keys(), not __iter__
                if indexed is not None and indexed.get(name, f.name) != f.name:
                    continue  # the index says another file holds it (a stale duplicate here is not read)
                if name in where:
                    raise UserError(
                        f"{path}: tensor {name!r} is in both {where[name].name} and {f.name}; "
                        f"keep one (or write a {INDEX_FILE} saying which)"
                    )
                where[name] = f
    missing = sorted(set(indexed or {}) - set(where))
    if missing:
        raise UserError(f"{path / INDEX_FILE} names tensor(s) its files lack: {few(missing)}")
    return where


def tensor_names(path: Path) -> list[str]:
    return list(hf_tensor_files(path))


def read_hf_config(path: Path) -> dict:
    """config.json of an HF directory that also has safetensors weights (UserError otherwise)."""
    weight_files(path)
    return json.loads((path / "config.json").read_text())
