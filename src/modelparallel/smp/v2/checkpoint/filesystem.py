"""``torch.sagemaker.distributed.checkpoint.filesystem``: DCP storage for a local
directory or any fsspec URL (``s3://`` with s3fs), with write hooks.

The writer is DCP's fsspec writer; the reader is modelparallel's safe one (checkpoint
metadata is read with an unpickler that accepts only DCP's own types, see
:mod:`modelparallel.checkpoint.storage`), so either can be passed to
``torch.distributed.checkpoint`` functions too (``load_sharded_optimizer_state_dict(...,
storage_reader=DistributedFileSystemReader(path))``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.checkpoint import SavePlan, SavePlanner
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.filesystem import FileSystem as LocalFileSystem
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from modelparallel.checkpoint.storage import SafeFsspecReader, is_url
from modelparallel.smp.v2.checkpoint.s3_filesystem import (
    S3FileSystem,
    format_s3_path,
    is_s3_uri,
    storage_options,
)

WriteHook = Callable[["DistributedFileSystemWriter"], Any]


def _location(path: str | os.PathLike) -> str | os.PathLike:
    return format_s3_path(path) if is_s3_uri(path) else path


class DistributedFileSystemWriter(FsspecWriter):
    """DCP's file-system writer for ``path`` (a directory or an fsspec URL).

    ``pre_write_hooks`` run as ``hook(writer)`` on every rank before it writes its data;
    ``post_write_hooks`` run as ``hook(writer)`` on every rank once the whole checkpoint
    is written (its metadata too), when :mod:`state_dict_saver` ``save``/``async_save``
    wrote it (in the background for ``async_save``, before its call counts as done).
    ``writer.is_coordinator`` says whether this rank wrote the metadata. ``s3_region``:
    the bucket's region for an ``s3://`` path. The other arguments are DCP's
    ``FileSystemWriter``'s.
    """

    def __init__(self, path: str | os.PathLike, single_file_per_rank: bool = True,
                 sync_files: bool = True, thread_count: int = 1,
                 per_thread_copy_ahead: int = 10_000_000, overwrite: bool = True,
                 pre_write_hooks: Sequence[WriteHook] | None = None,
                 post_write_hooks: Sequence[WriteHook] | None = None,
                 s3_region: str | None = None, **kwargs: Any) -> None:
        self._storage_options = {**storage_options(s3_region), **kwargs}
        super().__init__(_location(path), single_file_per_rank, sync_files, thread_count,
                         per_thread_copy_ahead, overwrite=overwrite, **self._storage_options)
        self.pre_write_hooks = list(pre_write_hooks or [])
        self.post_write_hooks = list(post_write_hooks or [])
        self.is_coordinator = False

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:  # keep the storage options (DCP's reset drops them)
            self.path = self.fs.init_path(_location(checkpoint_id), **self._storage_options)
        super().reset(None)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        for hook in self.pre_write_hooks:
            hook(self)
        return super().write_data(plan, planner)

    def run_post_write_hooks(self) -> None:
        """Run ``post_write_hooks`` (the saver calls this once the checkpoint is written)."""
        for hook in self.post_write_hooks:
            hook(self)


class DistributedFileSystemReader(SafeFsspecReader):
    """DCP's file-system reader for ``path`` (a directory or an fsspec URL), reading
    checkpoint metadata safely. ``s3_region``: the bucket's region for ``s3://``."""

    def __init__(self, path: str | os.PathLike, s3_region: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(_location(path), **{**storage_options(s3_region), **kwargs})


def path_to_file_system(path: str | os.PathLike, s3_region: str | None = None) -> FileSystemBase:
    """DCP's file system for ``path``: :class:`S3FileSystem` for ``s3://``, fsspec's for
    other URLs, the local one for plain paths (each has ``concat_path``,
    ``create_stream``, ``exists``, ...)."""
    if is_s3_uri(path):
        fs: FileSystemBase = S3FileSystem(s3_region)
    elif is_url(path):
        fs = FsspecFileSystem()
    else:
        return LocalFileSystem()
    fs.init_path(path)
    return fs


__all__ = ["DistributedFileSystemReader", "DistributedFileSystemWriter", "path_to_file_system"]
