"""Every ``torch.distributed`` collective and point-to-point call, recorded per process:
its sequence number on its group, a fingerprint (operation, shape, dtype) and the
user's line that made it. Calls from other threads (a background checkpoint writer's)
are not recorded.

The record is what the other ranks compare (``diagnose``): two ranks whose calls with
the same number on the same group differ have diverged. The calls are wrapped where
user code and the library find them (``torch.distributed.<op>``); collectives torch
issues from C++ (FSDP2's, DTensor's) are not recorded, and a hang in one is placed by
the ranks' stacks instead. A call made inside a recorded one (``all_gather_object``
uses ``all_gather``) is not recorded twice.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from modelparallel.doctor import frames

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "reduce", "barrier", "all_to_all",
               "all_to_all_single", "gather", "scatter", "all_gather_object",
               "broadcast_object_list", "gather_object", "scatter_object_list",
               "monitored_barrier")
POINT_TO_POINT = ("send", "recv", "isend", "irecv")
_RECORD_BYTES = 1024
_PEER_ARG = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}


@dataclass
class Call:
    """One call: ``seq`` counts the calls on ``group`` (global ranks) in this process."""

    op: str
    group: str  # the process group's name (two groups of the same ranks differ)
    ranks: tuple[int, ...]  # its members (global ranks)
    seq: int
    shape: str
    dtype: str
    site: str
    start: float
    peer: int | None = None  # point-to-point: the other rank

    def fingerprint(self) -> tuple[str, str, str]:
        return self.op, self.shape, self.dtype

    def key(self) -> tuple[str, int]:
        return self.group, self.seq

    def describe(self) -> str:
        what = f"{self.op}({self.shape}, {self.dtype})" if self.shape else self.op
        if self.peer is not None:
            what += f" {'to' if self.op in ('send', 'isend') else 'from'} rank {self.peer}"
        return f"{what} at {self.site}"

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)  # dataclasses.asdict deep-copies: 10x slower


class Recorder:
    """This process's calls: the one in progress and the last ``keep``."""

    def __init__(self, keep: int = 64, last_call_fd: int | None = None):
        self.recent: deque[Call] = deque(maxlen=keep)
        self.current: Call | None = None
        self.seqs: dict[str, int] = {}  # calls begun per group (name)
        # id(group) -> (group, name, ranks); holding the group keeps its id from reuse
        self._groups: dict[int, tuple[Any, str, tuple[int, ...]]] = {}
        self.calls = 0  # how many calls began (the watchdog publishes on change)
        self.last_failed: Call | None = None  # the last call that raised
        self._local = threading.local()
        self.installed: list[tuple[Any, str, Any]] = []
        # the last call begun, rewritten in place at every call (a few microseconds): what
        # the launcher reads when a rank died too suddenly to say anything (gloo aborts
        # the process on a size mismatch)
        self.last_call_fd = last_call_fd

    def install(self) -> None:
        """Wrap the calls in ``torch.distributed`` (and ``distributed_c10d``)."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        for name in (*COLLECTIVES, *POINT_TO_POINT):
            original = getattr(distributed_c10d, name, None)
            if original is None or getattr(original, "_mp_recorded", False):
                continue
            wrapped = self._wrap(name, original)
            for module in (dist, distributed_c10d):
                if getattr(module, name, None) is original:
                    self.installed.append((module, name, original))
                    setattr(module, name, wrapped)

    def uninstall(self) -> None:
        for module, name, original in reversed(self.installed):
            setattr(module, name, original)
        self.installed.clear()

    def _wrap(self, name: str, original: Callable) -> Callable:
        import inspect

        params = list(inspect.signature(original).parameters)
        group_at = params.index("group") if "group" in params else None
        peer_arg = _PEER_ARG.get(name)
        peer_at = params.index(peer_arg) if peer_arg in params else None

        main = threading.main_thread().ident

        @functools.wraps(original)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            # the main thread's calls only: the stacks the doctor reads are its too
            if threading.get_ident() != main or getattr(self._local, "inside", False):
                return original(*args, **kwargs)
            group = kwargs.get("group", args[group_at] if group_at is not None
                               and len(args) > group_at else None)
            peer = kwargs.get(peer_arg, args[peer_at] if peer_at is not None
                              and len(args) > peer_at else None) if peer_arg else None
            call = self._begin(name, group, args[0] if args else None, peer)
            self._local.inside = True
            try:
                return original(*args, **kwargs)
            except BaseException:
                self.last_failed = call
                raise
            finally:
                self._local.inside = False
                self.current = None
                self.recent.append(call)

        recorded._mp_recorded = True  # type: ignore[attr-defined]
        return recorded

    def _begin(self, op: str, group: Any, first: Any, peer: Any) -> Call:
        name, ranks = self._group(group)
        seq = self.seqs.get(name, 0) + 1
        self.seqs[name] = seq
        shape, dtype = _shape_dtype(first)
        call = Call(op, name, ranks, seq, shape, dtype, frames.site(sys._getframe(2)),
                    time.time(), int(peer) if isinstance(peer, int) else None)
        self.calls += 1
        self.current = call
        if self.last_call_fd is not None:
            os.pwrite(self.last_call_fd, _record(call).ljust(_RECORD_BYTES), 0)
        return call

    def _group(self, group: Any) -> tuple[str, tuple[int, ...]]:
        import torch.distributed as dist

        pg = group or dist.group.WORLD
        known = self._groups.get(id(pg))
        if known is None:
            try:
                known = (pg, str(getattr(pg, "group_name", "") or id(pg)),
                         tuple(dist.get_process_group_ranks(pg)))
            except (RuntimeError, ValueError, AttributeError):
                known = (pg, "?", ())
            self._groups[id(pg)] = known
        return known[1], known[2]


def _record(call: Call) -> bytes:
    """``call`` as JSON, built by hand: ``json.dumps`` would triple the doctor's cost per
    call. Strings that may need escaping (the site, the group name) go through
    ``_quoted``, cached."""
    return (f'{{"op": "{call.op}", "group": {_quoted(call.group)}, '
            f'"ranks": {list(call.ranks)}, "seq": {call.seq}, "shape": "{call.shape}", '
            f'"dtype": "{call.dtype}", "site": {_quoted(call.site)}, "start": {call.start}, '
            f'"peer": {"null" if call.peer is None else call.peer}}}').encode()


@functools.lru_cache(maxsize=4096)
def _quoted(text: str) -> str:
    return json.dumps(text)


def _shape_dtype(first: Any) -> tuple[str, str]:
    """The shape and dtype of a call's first argument (a tensor, or a list of them)."""
    if isinstance(first, (list, tuple)):
        inner = first[0] if first else None
        shape, dtype = _shape_dtype(inner) if hasattr(inner, "shape") else ("", "")
        return f"{len(first)} x [{shape}]" if shape else f"{len(first)} objects", dtype
    if hasattr(first, "shape") and hasattr(first, "dtype"):
        return ", ".join(str(d) for d in first.shape) or "scalar", \
            str(first.dtype).replace("torch.", "")
    return "", ""
