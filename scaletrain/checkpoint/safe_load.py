"""Loading that never runs code from a checkpoint: DCP's metadata is unpickled by an allow-list unpickler, tensors
come through DCP (which loads its byte items with `weights_only=True`) and our own metadata is JSON."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from scaletrain.errors import UserError

# What DCP's .metadata pickles name (recorded from our checkpoints, torch 2.13), and nothing else: not whole modules,
# whose other classes (FileSystemWriter, a Future, ...) a crafted pickle could construct. torch dtypes, layouts
# and memory formats are admitted by value in find_class.
_DCP = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP, "Metadata"),
    (_DCP, "StorageMeta"),
    (_DCP, "MetadataIndex"),
    (_DCP, "TensorStorageMetadata"),
    (_DCP, "BytesStorageMetadata"),
    (_DCP, "ChunkStorageMetadata"),
    (_DCP, "TensorProperties"),
    (_DCP, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"),
}


class UnsafeCheckpointError(UserError):
    """A checkpoint file asks to import something outside the allow-list: it is not loaded."""


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"checkpoint metadata refers to '{module}.{name}', which a checkpoint never "
            "needs; refusing to load it (it could run code)"
        )


def safe_unpickle(data: bytes) -> Any:
    return _AllowListUnpickler(io.BytesIO(data)).load()


class _SafeMetadataMixin:
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = safe_unpickle(f.read())
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path} does not hold checkpoint metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_SafeMetadataMixin, FileSystemReader):
    pass


class SafeFsspecReader(_SafeMetadataMixin, FsspecReader):
    pass


def make_reader(path: str) -> FileSystemReader:
    return SafeFsspecReader(path) if "://" in path else SafeFileSystemReader(path)


def read_metadata(path: str) -> Metadata:
    return make_reader(path).read_metadata()
