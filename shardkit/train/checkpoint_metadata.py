"""Reading a DCP checkpoint's `.metadata` without letting it run code.

torch.distributed.checkpoint stores the checkpoint's index (which tensor chunk lies at which offset of
which file) as a pickle, and its `FileSystemReader` reads it with plain `pickle.load`: a crafted
`.metadata` would run any code on `--resume`, on a population-based-training copy, or on any inspection.
`SafeFileSystemReader` reads it through an unpickler that admits only the metadata types DCP writes
(its dataclasses, `torch.Size`, dtypes and layouts, paths) and refuses anything else with a `ValueError`
naming the file and the refused name, before that name is ever imported or called. It also refuses a
storage entry that points outside the checkpoint directory.
"""

from __future__ import annotations

import enum
import os
import pickle
from pathlib import Path, PurePath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

METADATA_NAME = ".metadata"

# Every global a DCP `.metadata` refers to (torch 2.6 to 2.13): each is a plain data constructor.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            # Python 3.11.0-3.11.4 pickles an enum member as getattr(its class, its name) (_MEM_FORMAT_ENCODING in
            # every DCP index): only a member of an admitted enum is looked up, nothing else.
            return self._enum_member
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # dtypes pickle as `torch.float32` etc.
        raise ValueError(f"{self.source} refers to {module}.{name}, which is not a checkpoint metadata type: "
                         "refusing to load it (a checkpoint must never run code); was it crafted or written "
                         "by something other than torch.distributed.checkpoint?")

    def _enum_member(self, owner: Any, name: Any) -> Any:
        """`getattr(owner, name)` as an old Python pickles an enum member; any other lookup is refused."""
        if isinstance(owner, type) and issubclass(owner, enum.Enum) and isinstance(name, str) \
                and name in owner.__members__:
            return owner.__members__[name]
        raise ValueError(f"{self.source} looks up {getattr(owner, '__name__', type(owner).__name__)}.{name} "
                         "through getattr, which is not an enum member of a checkpoint metadata type: refusing to "
                         "load it (a checkpoint must never run code)")


def read_metadata(path: str | os.PathLike) -> Metadata:
    """The DCP `Metadata` in the file `path`, read with the restricted unpickler.

    Raises:
        ValueError: the file names a type outside the metadata types, is not a DCP index, or points
            a storage entry outside its directory.
        OSError: the file cannot be read.
    """
    with open(path, "rb") as handle:
        try:
            metadata = _MetadataUnpickler(handle, str(path)).load()
        except ValueError:
            raise
        except Exception as err:  # a damaged pickle raises any of a dozen types
            raise ValueError(f"{path} is damaged ({type(err).__name__}: {err})") from err
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path} is not a torch.distributed.checkpoint index ({type(metadata).__name__})")
    for entry in (metadata.storage_data or {}).values():
        relative = getattr(entry, "relative_path", None)
        if not isinstance(relative, str) or relative != PurePath(relative).name or relative in (".", ".."):
            raise ValueError(f"{path} points a storage entry at {relative!r}, outside its checkpoint directory")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with `.metadata` read by `read_metadata` instead of `pickle.load`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"
        metadata = read_metadata(Path(os.fspath(self.path)) / name)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
