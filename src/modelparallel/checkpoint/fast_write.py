"""Faster checkpoint files on top of DCP's public ``FileSystemWriter`` / ``FileSystem``.

Two things make a sharded save slower than the disk (measured in ``bench/checkpoint.py``):

- ``torch.save`` (DCP's per-tensor serialization) computes a CRC32 of every byte by
  default: on this machine that costs as much as copying the bytes. ``torch.load`` never
  checks it, so the writers here turn it off (``torch.serialization.set_crc32_options``,
  process-wide while a checkpoint is being written; a ``torch.save`` elsewhere in the
  process meanwhile also skips it, and still loads).
- DCP writes a whole file, then ``fsync``s it: the disk starts writing only when the
  serialization is over. On Linux the writer here asks the kernel to start writing back
  every ``WRITEBACK_BYTES`` as they are written (``sync_file_range(SYNC_FILE_RANGE_WRITE)``,
  a hint that waits for nothing), so the final ``fsync`` (still made, as before: a
  checkpoint is on the disk before it is committed) has little left to do.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

WRITEBACK_BYTES = 8 << 20
"""Bytes written between two requests to start writing them back to the disk."""
_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start writeback of dirty pages, do not wait


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux), or None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_start_writeback = _sync_file_range()


class _WritebackStream(io.BufferedWriter):
    """A buffered file that starts the writeback of each ``WRITEBACK_BYTES`` written."""

    def __init__(self, raw: io.RawIOBase) -> None:
        super().__init__(raw, buffer_size=1 << 20)
        self._requested = 0  # bytes before this offset are being written back

    def write(self, data: Any) -> int:
        n = super().write(data)
        end = self.tell()
        if end - self._requested >= WRITEBACK_BYTES and _start_writeback is not None:
            self.flush()
            # a hint: an error here (an unsupported filesystem) leaves it to fsync
            _start_writeback(self.fileno(), self._requested, end - self._requested,
                             _SYNC_FILE_RANGE_WRITE)
            self._requested = end
        return n


class _WritebackFileSystem(FileSystem):
    """DCP's local ``FileSystem`` whose files opened for writing start their writeback
    early (see :class:`_WritebackStream`)."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode or "b" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with _WritebackStream(io.FileIO(os.fspath(path), "w")) as stream:
            yield stream


_crc_lock = threading.Lock()
_crc_users = 0
_crc_before = True


@contextlib.contextmanager
def without_crc32() -> Iterator[None]:
    """``torch.save`` without CRC32s while any thread is inside (re-entrant, thread-safe);
    the setting found on entry of the first is restored on exit of the last."""
    global _crc_users, _crc_before
    with _crc_lock:
        if _crc_users == 0:
            _crc_before = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _crc_users += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                torch.serialization.set_crc32_options(_crc_before)


class FastFileSystemWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` (same files, same arguments) without CRC32s, starting
    the writeback to the disk while it writes."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        if _start_writeback is not None and self.sync_files:
            self.fs = _WritebackFileSystem()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with without_crc32():
            return super().write_data(plan, planner)


class FastFsspecWriter(FsspecWriter):
    """DCP's ``FsspecWriter`` (same files, same arguments) without CRC32s."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with without_crc32():
            return super().write_data(plan, planner)
