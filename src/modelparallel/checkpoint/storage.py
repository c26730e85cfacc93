"""Where checkpoints live: a local directory or any fsspec URL, read back safely.

Every path operation goes through fsspec (plain paths map to the local filesystem), so
``memory://``, ``file://`` and ``s3://`` (with s3fs installed) behave alike. DCP itself
unpickles its ``.metadata`` file and ``torch.load``s non-tensor entries with
``weights_only=False``; the reader and planner here replace both with restricted
loaders, so a checkpoint file can never run code.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from typing import Any

import torch
from fsspec.core import url_to_fs
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from modelparallel.checkpoint import fast_read
from modelparallel.checkpoint.fast_write import FastFileSystemWriter, FastFsspecWriter


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message says why and what to do."""


def is_url(path: str | os.PathLike) -> bool:
    return "://" in os.fspath(path)


class Location:
    """A checkpoint root (directory or URL) and the filesystem that holds it."""

    def __init__(self, root: str | os.PathLike):
        self.root = os.fspath(root)
        self.fs, self._path = url_to_fs(self.root)

    def url(self, *parts: str) -> str:
        """A path below the root, in the root's own spelling (URL or local path)."""
        return "/".join([self.root.rstrip("/"), *parts]) if is_url(self.root) else \
            os.path.join(self.root, *parts)

    def _p(self, *parts: str) -> str:
        return "/".join([self._path.rstrip("/"), *parts])

    def exists(self, *parts: str) -> bool:
        return self.fs.exists(self._p(*parts))

    def children(self) -> list[str]:
        """Names directly under the root (empty when the root does not exist)."""
        if not self.fs.exists(self._p()):
            return []
        return sorted(os.path.basename(p.rstrip("/")) for p in self.fs.ls(self._p(), detail=False))

    def file_sizes(self, *parts: str) -> dict[str, int]:
        """Size of every file below ``parts``, by its path relative to it."""
        root = self._p(*parts).rstrip("/")
        found = self.fs.find(root, detail=True)
        return {path[len(root) + 1:]: int(entry["size"]) for path, entry in found.items()
                if entry.get("type") != "directory"}

    def read_text(self, *parts: str) -> str:
        with self.fs.open(self._p(*parts), "r") as f:
            return f.read()

    def read_bytes(self, *parts: str) -> bytes:
        with self.fs.open(self._p(*parts), "rb") as f:
            return f.read()

    def write_bytes(self, data: bytes, *parts: str) -> None:
        """Write a file; on a local disk it is on the disk (fsync) before this returns,
        so a commit that follows never names data an OS crash could lose."""
        self.fs.makedirs(self._p(*parts[:-1]), exist_ok=True)
        with self.fs.open(self._p(*parts), "wb") as f:
            f.write(data)
            if _replaces_atomically(self.fs):
                f.flush()
                os.fsync(f.fileno())

    def write_json(self, obj: Any, *parts: str) -> None:
        self.write_bytes(json.dumps(obj, indent=1, sort_keys=True).encode(), *parts)

    def read_json(self, *parts: str) -> Any:
        return json.loads(self.read_text(*parts))

    def write_atomically(self, text: str, name: str) -> None:
        """Replace the file ``name`` by ``text`` so readers see the old or the new one."""
        tmp = f".{name}.tmp-{os.getpid()}"
        self.write_bytes(text.encode(), tmp)
        if self.fs.exists(self._p(name)) and not _replaces_atomically(self.fs):
            self.fs.rm(self._p(name))
        self.fs.mv(self._p(tmp), self._p(name))

    def makedirs(self, *parts: str) -> None:
        self.fs.makedirs(self._p(*parts), exist_ok=True)

    def rename(self, old: str, new: str) -> None:
        """Rename a directory below the root (atomic on local filesystems)."""
        if _replaces_atomically(self.fs):
            os.rename(self._p(old), self._p(new))
        else:
            self.fs.mv(self._p(old), self._p(new), recursive=True)

    def remove(self, *parts: str) -> None:
        if self.fs.exists(self._p(*parts)):
            self.fs.rm(self._p(*parts), recursive=True)

    def writable(self) -> None:
        """Raise a CheckpointError unless the root can be created and written."""
        probe = f".write-test-{os.getpid()}"
        try:
            self.makedirs()
            self.write_bytes(b"", probe)
            self.fs.rm(self._p(probe))
        except (PermissionError, OSError) as e:
            raise CheckpointError(f"cannot write checkpoints to {self.root!r}: {e}; choose a "
                                  f"directory this user may write, or fix its permissions") from e


def _replaces_atomically(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


# -- safe reading --------------------------------------------------------------------
_ALLOWED_MODULES = ("torch.distributed.checkpoint.", "torch.distributed.tensor.")
_ALLOWED = {("torch", "Size"), ("torch", "device"), ("collections", "OrderedDict"),
            ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
            ("torch.serialization", "_get_layout"),  # looks up a torch.layout by name
            ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
            ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: its own dataclasses, torch dtypes/sizes, builtins; nothing
    else (no functions, no arbitrary classes)."""

    def find_class(self, module: str, name: str):
        # decide by name first: looking a class up imports its module, which runs code
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module.startswith(_ALLOWED_MODULES):
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        elif module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, torch.dtype | torch.layout | torch.memory_format):
                return obj
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a checkpoint's "
                                     f"metadata (only checkpoint metadata types are allowed)")


def _read_metadata(reader: FileSystemReader, rank: int | None) -> Metadata:
    path = reader._get_metadata_path(rank)
    try:
        with reader.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError as e:
        raise CheckpointError(f"{reader.path}: no checkpoint metadata (.metadata) — the "
                              f"checkpoint is missing or was never completed") from e
    except (EOFError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"{reader.path}: the checkpoint metadata is truncated or not a "
                              f"checkpoint ({e})") from e
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = reader.load_id
    return metadata


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return _read_metadata(self, kwargs.get("rank"))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's, reading straight into the destination tensors (``fast_read``)."""
        return fast_read.read_data(plan, planner, self.storage_data,
                                   lambda name: self.fs.concat_path(self.path, name),
                                   super().read_data)


class SafeFsspecReader(FsspecReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return _read_metadata(self, kwargs.get("rank"))


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, loading non-tensor entries with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = fast_read.load_bytes(value)  # torch.load(weights_only=True), faster
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def writer_for(path: str | os.PathLike, **kwargs: Any) -> FileSystemWriter:
    """DCP's writer for ``path`` (a directory or URL), without CRC32s and, on a local
    Linux disk, writing back to the disk while it writes (``fast_write``)."""
    return FastFsspecWriter(os.fspath(path), **kwargs) if is_url(path) else \
        FastFileSystemWriter(path, **kwargs)


def reader_for(path: str | os.PathLike) -> FileSystemReader:
    return SafeFsspecReader(os.fspath(path)) if is_url(path) else SafeFileSystemReader(path)
