"""Loading a DCP optimizer checkpoint without running code its files could carry.

torch.distributed.checkpoint keeps its `.metadata` as a pickle (FileSystemReader unpickles it as it is) and every
non-tensor value (the optimizer's param_groups: lr, betas, ...) as a torch.save pickle that DefaultLoadPlanner
loads with `weights_only=False`. A checkpoint lives in the run directory, which whoever can write it controls, so
neither is trusted here:

- `.metadata` is unpickled from the bytes already checked against the checkpoint's manifest, by an unpickler
  that admits only DCP's own metadata classes, torch.Size, dtypes and layouts, pathlib paths and plain
  containers; anything else (a `__reduce__` calling `os.system`, ...) is a CorruptError naming the file and the
  global it asked for. Every file the metadata points into must be one the manifest lists.
- non-tensor values are loaded with `torch.load(..., weights_only=True)` (tensors already are, by DCP itself).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from storage.fs import CorruptError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# module -> the names of it a genuine `.metadata` refers to (torch 2.x's DCP); nothing else is ever looked up
ALLOWED: dict[str, frozenset[str]] = {
    _DCP_METADATA: frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a layout by name (torch.strided)
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),  # StorageMeta.checkpoint_id
    "collections": frozenset({"OrderedDict"}),
}


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only ALLOWED names and torch dtypes; `where` names the file in errors."""

    def __init__(self, data: bytes, where: str):
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if name in ALLOWED.get(module, ()) or dtype:
            return super().find_class(module, name)
        raise CorruptError(
            f"{self.where}: refusing to unpickle {module}.{name}: a DCP metadata file holds only "
            "torch.distributed.checkpoint's metadata classes; the checkpoint is corrupted or was written by "
            "someone else"
        )


def load_metadata(data: bytes, where: str, names: set[str]) -> Metadata:
    """The DCP `Metadata` in `data` (the bytes of `where`), unpickled with `MetadataUnpickler`; every file it
    points into must be in `names` (the DCP files the checkpoint's manifest lists, relative to their folder)."""
    try:
        metadata = MetadataUnpickler(data, where).load()
    except CorruptError:
        raise
    except Exception as exc:  # a truncated or malformed pickle
        raise CorruptError(f"{where}: not a DCP metadata file ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CorruptError(f"{where}: holds a {type(metadata).__name__}, not DCP Metadata")
    for info in metadata.storage_data.values():
        path = getattr(info, "relative_path", None)
        if path not in names:
            raise CorruptError(f"{where}: points into {path!r}, which the checkpoint's manifest does not list")
    return metadata


class VerifiedReader(FileSystemReader):
    """DCP's file reader whose metadata comes from verified bytes through `load_metadata`."""

    def __init__(self, path: str, metadata: bytes, where: str, names: set[str]):
        super().__init__(path)
        self._metadata, self._where, self._names = metadata, where, names

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = load_metadata(self._metadata, self._where, self._names)
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but a non-tensor value is loaded with `weights_only=True` (plain containers,
    numbers, strings, tensors) instead of as an arbitrary pickle."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            fqn = read_item.dest_index.fqn
            lines = [line for line in str(exc).splitlines() if "GLOBAL" in line] or str(exc).splitlines()[:1]
            raise CorruptError(
                f"{self.where}: value {fqn!r} is not plain data ({' '.join(lines)}); the checkpoint is corrupted "
                "or was written by someone else"
            ) from None
        safe = io.BytesIO()
        torch.save(obj, safe)  # what weights_only admitted, re-serialized by us for DCP's own placement of it
        safe.seek(0)
        super().load_bytes(read_item, safe)
