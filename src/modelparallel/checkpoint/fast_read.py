"""Reading DCP's files with fewer copies than ``FileSystemReader.read_data``.

DCP stores each tensor as a ``torch.save`` archive inside the rank's file and loads it
with ``torch.load``: a new tensor is allocated (its pages faulted in), filled from the
file, then copied into the destination and freed. :func:`read_data` instead:

- asks the kernel to start reading every byte range the plan needs at once
  (``posix_fadvise(WILLNEED)``), so the disk works while the tensors are decoded;
- reads each archive's description without its data (``torch.load(...,
  map_location="meta", weights_only=True)``: the dtype, shape and strides, safely) and
  finds its data record with :mod:`zipfile`;
- reads the data straight into the destination tensor when it is the whole saved
  tensor, contiguous, of the same dtype (a checkpoint loaded under the layout that
  saved it); else into one buffer, viewed as the saved tensor, narrowed and copied;
- leaves everything else (stream transforms, archives of another shape, another byte
  order) to DCP's own path.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import struct
import sys
import zipfile
from collections.abc import Callable
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

_LOCAL_HEADER = 30  # bytes of a zip local file header before its name and extra field


class _Slice(io.RawIOBase):
    """``length`` bytes of ``file`` from ``offset``, as a seekable read-only file."""

    def __init__(self, file: io.RawIOBase, offset: int, length: int) -> None:
        super().__init__()
        self._file, self._start, self._length, self._pos = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._length - self._pos)
        if n <= 0:
            return 0
        got = _pread_into(self._file, view[:n], self._start + self._pos)
        self._pos += got
        return got


def _pread_into(file: io.RawIOBase, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``file`` at ``offset``; the number of bytes read (less at EOF)."""
    done = 0
    while done < len(view):
        n = os.preadv(file.fileno(), [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


def _read_exactly(file: io.RawIOBase, view: memoryview, offset: int) -> None:
    if _pread_into(file, view, offset) != len(view):
        raise EOFError(f"{len(view)} bytes at {offset}: the file ends before")


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor, writable."""
    return memoryview(cast(Any, tensor.reshape(-1).view(torch.uint8).numpy()))


def _start(archive: io.RawIOBase | io.BufferedIOBase, record: zipfile.ZipInfo) -> int:
    """Where the bytes of a stored (uncompressed) zip record begin (read by hand:
    ``zipfile`` would check a CRC32, which DCP's files written here do not have)."""
    header = bytearray(_LOCAL_HEADER)
    archive.seek(record.header_offset)
    archive.readinto(header)
    name_len, extra_len = struct.unpack_from("<HH", header, 26)
    return record.header_offset + _LOCAL_HEADER + name_len + extra_len


def _record_bytes(archive: io.RawIOBase | io.BufferedIOBase, record: zipfile.ZipInfo) -> bytes:
    data = bytearray(record.file_size)
    archive.seek(_start(archive, record))
    archive.readinto(data)
    return bytes(data)


def _data_record(archive: _Slice) -> tuple[int, int, bool] | None:
    """Offset and size of the only tensor data record of a ``torch.save`` archive, and
    whether it was written in this machine's byte order; None for another shape."""
    with zipfile.ZipFile(archive) as z:
        records = z.infolist()
    data = [r for r in records if r.filename.split("/")[-2:-1] == ["data"]]
    order = [r for r in records if r.filename.endswith("/byteorder")]
    if len(data) != 1 or data[0].compress_type != zipfile.ZIP_STORED:
        return None
    native = not order or _record_bytes(archive, order[0]).decode() == sys.byteorder
    return _start(archive, data[0]), data[0].file_size, native


_DAMAGED = (zipfile.BadZipFile, EOFError, ValueError, RuntimeError, pickle.UnpicklingError,
            struct.error)  # what reading a damaged archive raises here


class _NotPlain(Exception):
    pass


class _PlainUnpickler(pickle.Unpickler):
    """Builds numbers, strings, bytes, None, lists, tuples, dicts and sets only: it
    refuses every class or function (and every tensor), so it cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        raise _NotPlain(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _NotPlain("a tensor")


def load_bytes(value: io.BytesIO) -> Any:
    """``torch.load(value, weights_only=True)`` of a ``torch.save``d value (DCP's
    non-tensor entries: the optimizer's settings, ...): plain Python values are
    unpickled directly (a few times faster), anything else by ``torch.load``."""
    try:
        with zipfile.ZipFile(value) as z:
            records = [r for r in z.infolist() if r.filename.endswith("/data.pkl")]
            if len(records) == 1 and records[0].compress_type == zipfile.ZIP_STORED and \
                    all(r.filename.split("/")[-2:-1] != ["data"] for r in z.infolist()):
                return _PlainUnpickler(io.BytesIO(_record_bytes(value, records[0]))).load()
    except (_NotPlain, zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError):
        pass
    value.seek(0)
    return torch.load(value, weights_only=True)


def _read_tensor(file: io.RawIOBase, offset: int, length: int, req: ReadItem,
                 target: torch.Tensor) -> bool:
    """Read the archive at ``offset`` into ``target``; False (nothing read) when it is
    not one plain tensor in this byte order."""
    archive = _Slice(file, offset, length)
    found = _data_record(archive)
    if found is None or not found[2]:
        return False
    start, nbytes, _ = found
    archive.seek(0)
    meta = torch.load(cast(IO[bytes], archive), map_location="meta", weights_only=True)
    if not isinstance(meta, torch.Tensor) or meta.untyped_storage().nbytes() != nbytes:
        return False
    whole = list(req.storage_offsets) == [0] * meta.dim() and \
        list(req.lengths) == list(meta.shape)
    if whole and meta.is_contiguous() and meta.storage_offset() == 0 and \
            meta.numel() * meta.element_size() == nbytes and target.device.type == "cpu" \
            and target.is_contiguous() and target.dtype == meta.dtype and \
            target.shape == meta.shape:
        _read_exactly(file, _bytes_of(target), offset + start)
        return True
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    _read_exactly(file, _bytes_of(buffer), offset + start)
    saved = torch.empty(0, dtype=meta.dtype).set_(buffer.untyped_storage(),
                                                   meta.storage_offset(), meta.shape,
                                                   meta.stride())
    for dim, (first, size) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
        saved = saved.narrow(dim, first, size)
    if saved.shape != target.shape:
        return False
    target.copy_(saved)
    return True


def prefetch(fd: int, ranges: list[tuple[int, int]]) -> None:
    """Ask the kernel to start reading these (offset, length) ranges of ``fd``."""
    merged: list[list[int]] = []
    for offset, length in sorted(ranges):
        if merged and offset <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], offset + length)
        else:
            merged.append([offset, offset + length])
    for first, end in merged if hasattr(os, "posix_fadvise") else []:  # not on macOS
        os.posix_fadvise(fd, first, end - first, os.POSIX_FADV_WILLNEED)


def read_data(plan: LoadPlan, planner: LoadPlanner, storage_data: dict[Any, Any],
              path_of: Callable[[str], str | os.PathLike],
              fallback: Callable[[LoadPlan, LoadPlanner], Future[None]]) -> Future[None]:
    """``FileSystemReader.read_data`` for local files (see the module's docstring).
    ``fallback`` (DCP's) reads what this does not: an item of another shape, and, from
    the first item that is damaged (a truncated file) on, the rest of the plan in DCP's
    order, so that DCP raises the error it would have raised."""
    if not hasattr(os, "preadv") or \
            any(storage_data[r.storage_index].transform_descriptors for r in plan.items):
        return fallback(plan, planner)
    per_file: dict[str, list[ReadItem]] = {}
    for req in plan.items:
        per_file.setdefault(storage_data[req.storage_index].relative_path, []).append(req)
    ordered = [req for reqs in per_file.values() for req in reqs]  # DCP's order
    files = {name: io.FileIO(os.fspath(path_of(name)), "r") for name in per_file}
    try:
        for name, reqs in per_file.items():
            prefetch(files[name].fileno(), [(storage_data[r.storage_index].offset,
                                             storage_data[r.storage_index].length)
                                            for r in reqs])
        for i, req in enumerate(ordered):
            info = storage_data[req.storage_index]
            file = files[info.relative_path]
            try:
                if req.type == LoadItemType.BYTE_IO:
                    data = bytearray(info.length)
                    if _pread_into(file, memoryview(data), info.offset) != info.length:
                        raise EOFError("truncated")
                    planner.load_bytes(req, io.BytesIO(data))
                    continue
                target = planner.resolve_tensor(req).detach()
                if _read_tensor(file, info.offset, info.length, req, target):
                    planner.commit_tensor(req, target)
                else:
                    fallback(dataclasses.replace(plan, items=[req]), planner).wait()
            except _DAMAGED:
                return fallback(dataclasses.replace(plan, items=ordered[i:]), planner)
    finally:
        for file in files.values():
            file.close()
    done: Future[None] = Future()
    done.set_result(None)
    return done
