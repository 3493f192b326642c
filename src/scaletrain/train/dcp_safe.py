"""DCP's readers for scaletrain checkpoints, refusing what a checkpoint never holds.

Loading unpickles nothing but an explicit list of DCP's metadata classes (a restricted unpickler
refuses every other global, and any dotted name), and a pickled object in place of a tensor is
refused. Its own module: DCP and DTensor cost about a second of imports, paid by the processes
that read or write tensors, not by a launcher or a config check (scaletrain.train.checkpoint
imports it when it loads).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from scaletrain.errors import CheckpointError


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata and refuses any other global (os.system, eval, ...).

    Only the classes listed here, by exact name: a dotted name ("os.system" looked up through a
    module that happens to import os) or any other attribute of an allowed module is refused."""

    _allowed = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata", "MetadataIndex", "TensorProperties", "ChunkStorageMetadata", "TensorStorageMetadata",
            "BytesStorageMetadata", "StorageMeta", "_MEM_FORMAT_ENCODING"},
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"},
        "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
        "collections": {"OrderedDict"},
    }

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and "." not in name and isinstance(getattr(torch, name, None), torch.dtype)
        if "." not in name and (name in self._allowed.get(module, ()) or is_dtype):
            return super().find_class(module, name)
        raise CheckpointError(f"refusing to load: the checkpoint metadata asks to unpickle {module}.{name}, "
                              "which a checkpoint never needs; the folder may have been tampered with")


class SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise CheckpointError(f"refusing to load: the checkpoint stores a pickled object at "
                              f"{read_item.dest_index.fqn}; scaletrain checkpoints hold tensors only")
