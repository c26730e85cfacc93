"""Peak of allocated CPU tensor memory while a block runs, measured from the allocator."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import tempfile
import weakref
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

_CPU_DEVICE_TYPE = 0  # "Device Type" of a CPU "[memory]" event in the profiler's trace
# Kineto's log level is read once, when its first profiler starts; 6 is above its
# "USDT" level (5), whose profiler_start/profiler_stop lines it prints on every start.
_KINETO_LOG_LEVEL = "KINETO_LOG_LEVEL"
_KINETO_QUIET = "6"
_UNKNOWN_FREE_WARNING = b"Memory block of unknown size"
_allocator_warning_spent = False  # whether this process's first such warning was taken


class PeakTensorMemory:
    """Peak bytes of CPU tensor storage alive while the ``with`` block runs.

    ::

        with PeakTensorMemory() as mem:
            train_step(batch)
        mem.start_bytes, mem.peak_bytes, mem.end_bytes

    ``start_bytes``: at entry, the ``untyped_storage().nbytes()`` of every distinct CPU
    storage (by data pointer) of a tensor reachable from ``gc.get_objects()``, with the
    ``.grad`` of leaf tensors and the inner tensors of wrapper subclasses (a DTensor
    counts its ``_local_tensor``, the wrapper nothing). Meta, fake and device tensors
    count nothing. A storage only C++ holds (say, saved for backward by a graph still
    alive) is missed here.

    The block runs under ``torch.profiler`` with ``profile_memory=True``, which records
    every allocation and free of the CPU allocator made by threads that carry the
    profiler's state: the calling thread and the threads PyTorch hands work to
    (the autograd engine's). Allocations by threads PyTorch did not start for it (a
    ``threading.Thread``, gloo's worker threads) are not seen; CPU collectives allocate
    their outputs on the calling thread. ``peak_bytes`` = ``start_bytes`` + the largest
    running sum of those allocations and frees, taken in order (so at least
    ``start_bytes``); ``end_bytes`` = ``start_bytes`` + their net. Memory not allocated
    through the CPU allocator (gloo's own buffers, Python objects, the interpreter)
    counts nothing.

    The allocator tells the size of a free only for blocks allocated while a profiler
    watched; the frees of the others (allocated before the block) are matched here by
    address against the storages found at entry. A storage found at entry and freed
    in the block without a record (or shrunk, ``resize_``) is noticed when its address is
    allocated again (then subtracted at that point) or at exit: ``unseen_free_bytes``
    sums those, and ``exact`` is False when it is not 0, in which case ``peak_bytes``
    is an upper bound (the bytes are taken as freed as late as possible). The C++
    allocator logs a warning ("Memory block of unknown size ...") for the first such free
    and every 1000th after; the first is taken by a free of this probe's own, silently.

    Profiling slows the block (each op is recorded); the scan at entry walks every
    Python object.
    """

    def __init__(self) -> None:
        self.start_bytes = 0
        self._start: dict[int, int] = {}
        self._refs: dict[int, tuple[weakref.ref[Any], int]] = {}
        self._prof: profile | None = None
        self._gone: set[int] = set()  # addresses found at entry, no longer there at exit
        self._result: tuple[int, int, int, int] | None = None

    @property
    def peak_bytes(self) -> int:
        """The largest number of tensor bytes alive at once in the block."""
        return self._measured()[0]

    @property
    def end_bytes(self) -> int:
        """``start_bytes`` plus the net of the block's allocations and frees."""
        return self._measured()[1]

    @property
    def unseen_free_bytes(self) -> int:
        """Bytes of storages found at entry whose free in the block had no record."""
        return self._measured()[2]

    @property
    def events(self) -> int:
        """How many allocator events the profiler recorded in the block."""
        return self._measured()[3]

    @property
    def exact(self) -> bool:
        """Whether every free inside the block was recorded (``peak_bytes`` is exact)."""
        return self.unseen_free_bytes == 0

    def __enter__(self) -> PeakTensorMemory:
        self._result = None
        self._start = live_cpu_storages(self._refs)
        self.start_bytes = sum(self._start.values())
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                             record_shapes=False, with_stack=False)
        spare = [] if _allocator_warning_spent else [torch.empty(1)]
        with _kineto_quiet():
            self._prof.__enter__()
        if spare:
            _spend_allocator_warning(spare)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Stop the profiler; the events are read at the first look at the results."""
        if self._prof is None:
            raise RuntimeError("PeakTensorMemory exited without being entered")
        self._prof.__exit__(exc_type, exc, tb)
        self._gone = {addr for addr, (ref, _) in self._refs.items() if _moved(ref(), addr)}
        self._refs = {}

    def _measured(self) -> tuple[int, int, int, int]:
        if self._result is None:
            if self._prof is None:
                raise RuntimeError("PeakTensorMemory: use it in a with block first")
            events = _memory_events(self._prof)
            self._result = self._account(events)
            self._prof, self._start, self._gone = None, {}, set()
        return self._result

    def _account(self, events: list[tuple[int, int]]) -> tuple[int, int, int, int]:
        live = dict(self._start)  # address -> bytes of the blocks believed alive
        pre = set(live)  # addresses of blocks found at entry, not yet freed or reused
        current = peak = self.start_bytes
        unseen = 0
        for addr, nbytes in events:
            if nbytes > 0:
                if addr in live:  # the block there was freed without a record
                    current -= live[addr]
                    unseen += live[addr]
                pre.discard(addr)
                live[addr] = nbytes
                current += nbytes
                peak = max(peak, current)
            elif addr in live:  # its size as known here (the allocator's may be stale)
                current -= live.pop(addr)
                pre.discard(addr)
            # else: a block allocated before the block ran that no scan found: it was
            # not counted at entry, so its free is not subtracted
        for addr in pre & self._gone:  # found at entry, gone at exit, no event at its address
            current -= self._start[addr]
            unseen += self._start[addr]
        return peak, current, unseen, len(events)


@contextlib.contextmanager
def _kineto_quiet() -> Iterator[None]:
    """Kineto at its log level above "USDT" if it starts here (unless the user set one);
    the environment is restored after, so child processes are not affected."""
    if _KINETO_LOG_LEVEL in os.environ:
        yield
        return
    os.environ[_KINETO_LOG_LEVEL] = _KINETO_QUIET
    try:
        yield
    finally:
        os.environ.pop(_KINETO_LOG_LEVEL, None)


def _spend_allocator_warning(spare: list[torch.Tensor]) -> None:
    """Free the tensor in ``spare`` (allocated before the profiler started), stderr captured.

    c10's CPU allocator logs "Memory block of unknown size ..." for the 1st, 1001st, ...
    free of a block allocated before a memory profiler started: frees this probe expects
    and accounts for (see the class docstring). No API sets c10's log level after torch
    is imported, so the first such free is made here, once per process, and its line is
    dropped; anything else written to stderr meanwhile (other threads) is passed on.
    """
    global _allocator_warning_spent
    _allocator_warning_spent = True
    sys.stderr.flush()
    with tempfile.TemporaryFile() as captured:
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            spare.clear()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        other = [line for line in captured.read().splitlines(keepends=True)
                 if _UNKNOWN_FREE_WARNING not in line]
    if other:
        os.write(2, b"".join(other))


def live_cpu_storages(refs: dict[int, tuple[weakref.ref[Any], int]] | None = None
                      ) -> dict[int, int]:
    """Data pointer -> bytes of each distinct CPU storage of the tensors Python reaches.

    ``refs``, when given, receives a weak reference to each storage and its size.
    """
    found: dict[int, int] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # type(): no __class__ lookups, no warnings
            _visit(obj, found, refs, 0)
    return found


def _visit(t: torch.Tensor, found: dict[int, int],
           refs: dict[int, tuple[weakref.ref[Any], int]] | None, depth: int) -> None:
    if depth > 4:
        return
    if t.is_leaf and t.requires_grad:
        grad = t.grad
        if grad is not None:
            _visit(grad, found, refs, depth + 1)
    if hasattr(t, "__tensor_flatten__"):  # a wrapper subclass (DTensor): its inner tensors
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                _visit(inner, found, refs, depth + 1)
        return
    if t.device.type != "cpu" or t.is_meta or type(t).__name__ == "FakeTensor":
        return
    try:
        storage = t.untyped_storage()
        if storage.device.type != "cpu":
            return
        addr, nbytes = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # no storage (sparse, functional wrappers,
        return  # the pipeline's stand-ins for other stages' parameters)
    if addr == 0 or nbytes == 0 or addr in found:
        return
    found[addr] = nbytes
    if refs is not None:
        refs[addr] = (weakref.ref(storage), nbytes)


def _moved(storage: torch.UntypedStorage | None, addr: int) -> bool:
    """Whether a storage found at ``addr`` was freed or moved (``resize_``) since."""
    return storage is None or storage.data_ptr() != addr


def _memory_events(prof: profile) -> list[tuple[int, int]]:
    """(address, +bytes or -bytes) of each CPU allocator event, in the order they happened.

    The profiler's public outputs that carry each memory event with its address and
    order are the chrome trace (``[memory]`` instant events: ``Addr``, ``Bytes``, ``ts``,
    ``Ev Idx``); ``events()``/``key_averages()`` fold the events into the ops around
    them and drop the addresses.
    """
    fd, path = tempfile.mkstemp(suffix=".json", prefix="mp-tensor-memory-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    rows = []
    for ev in trace.get("traceEvents", []):
        if ev.get("name") != "[memory]":
            continue
        args = ev.get("args", {})
        if args.get("Device Type") != _CPU_DEVICE_TYPE:
            continue
        rows.append((float(ev["ts"]), int(args.get("Ev Idx", 0)), int(args["Addr"]),
                     int(args["Bytes"])))
    rows.sort()
    return [(addr, nbytes) for _, _, addr, nbytes in rows]
