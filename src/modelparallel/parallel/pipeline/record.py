"""A pipeline schedule you can see: record what each rank ran, draw it, measure the bubble.

Every rank wraps its pipeline stages in a :class:`ScheduleRecorder` for one step; the
recorder times each forward (``F``), backward (``B``) and weight-gradient backward (``W``)
of every microbatch. :func:`gather_events` brings all ranks' events to every rank on one
time axis, :func:`render_grid` prints the rank x time grid and :func:`bubble_fraction`
measures the idle share, to compare with :func:`theoretical_bubble`::

    with ScheduleRecorder([stage], rank=mp.pp_rank()) as recorder:
        schedule.step(x, target=y)
    events = gather_events(recorder.events, group=mp.get_pp_process_group())
    print(render_grid(events))
"""

from __future__ import annotations

import functools
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining.stage import _PipelineStageBase

# stage method -> (event kind, keyword name of its microbatch id)
_WRAPPED = {
    "forward_one_chunk": ("F", "fwd_chunk_id"),
    "backward_one_chunk": ("B", "bwd_chunk_id"),
    "backward_weight_one_chunk": ("W", "bwd_chunk_id"),
}
_MISSING = object()  # marks "no instance attribute to restore"


@dataclass
class Event:
    """One computation a rank ran: ``kind`` of ``stage`` on ``microbatch``.

    ``kind`` is ``"F"`` (forward), ``"B"`` (full backward, or the input-gradient half of
    a zero-bubble schedule's split backward) or ``"W"`` (the weight-gradient half).
    ``start`` and ``end`` are seconds: ``time.perf_counter()`` when recorded, relative to
    the earliest start once passed through :func:`gather_events`.
    """

    rank: int
    stage: int
    kind: str
    microbatch: int
    start: float
    end: float


class ScheduleRecorder:
    """Times every F, B and W a schedule runs on ``stages`` while the recorder is active.

    ``with recorder:`` replaces ``forward_one_chunk``, ``backward_one_chunk`` and
    ``backward_weight_one_chunk`` on each stage object with a timing wrapper and puts
    the originals back on exit. Events are appended to :attr:`events` (a later ``with``
    adds to them; use a fresh recorder per step). ``rank`` labels this process's row in
    the grid: use ``mp.pp_rank()`` with the pipeline group in :func:`gather_events`.

    On a CUDA stage each recorded call synchronizes the device before and after, so the
    times are those of the kernels (not their launch) and waits for incoming activations
    are not billed to the op; this serializes a little and costs some speed while on.
    """

    def __init__(self, stages: Sequence[_PipelineStageBase], rank: int):
        self.stages = list(stages)
        self.rank = rank
        self.events: list[Event] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> ScheduleRecorder:
        if self._saved:
            raise RuntimeError("ScheduleRecorder is already active")
        for stage in self.stages:
            for name, (kind, key) in _WRAPPED.items():
                # remember an instance attribute that was already there (another wrapper)
                self._saved.append((stage, name, stage.__dict__.get(name, _MISSING)))
                setattr(stage, name, self._timed(stage, getattr(stage, name), kind, key))
        return self

    def __exit__(self, *exc: object) -> None:
        for stage, name, old in reversed(self._saved):
            if old is _MISSING:
                delattr(stage, name)  # the class method shows through again
            else:
                setattr(stage, name, old)
        self._saved.clear()

    def _timed(self, stage: _PipelineStageBase, fn: Callable[..., Any], kind: str,
               key: str) -> Callable[..., Any]:
        device = getattr(stage, "device", None)
        sync = isinstance(device, torch.device) and device.type == "cuda"

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # schedules run backward on a forward-only step as a no-op: nothing to record
            if kind != "F" and not getattr(stage, "has_backward", True):
                return fn(*args, **kwargs)
            microbatch = args[0] if args else kwargs[key]
            if sync:
                # finish queued work (p2p waits included) so it is not billed to this op
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if sync:
                torch.cuda.synchronize(device)  # kernels are async: wait until they ran
            end = time.perf_counter()
            self.events.append(Event(self.rank, stage.stage_index, kind, int(microbatch),
                                     start, end))
            return out

        return wrapper


def gather_events(events: list[Event], group: dist.ProcessGroup | None = None) -> list[Event]:
    """All ranks' events on every rank, in seconds since the earliest start of any rank.

    Collective over ``group`` (``all_gather_object``): every rank of it must call it.
    ``perf_counter`` clocks of processes on one machine are directly comparable. When the
    ranks span machines each one's events are moved onto its wall clock first, so the
    alignment across machines is only as good as their clock synchronization (NTP:
    typically a fraction of a millisecond to a few milliseconds) -- read short gaps
    between ranks on different hosts with care. Without an initialized process group the
    events come back relative to their own earliest start. Sorted by rank, then start.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return _relative(list(events))
    offset = time.time() - time.perf_counter()  # perf_counter -> wall clock on this host
    mine = (socket.gethostname(), offset, list(events))
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    one_host = len({host for host, _, _ in everyone}) == 1
    merged = []
    for _, off, evs in everyone:
        shift = 0.0 if one_host else off
        merged += [replace(e, start=e.start + shift, end=e.end + shift) for e in evs]
    return _relative(merged)


def _relative(events: list[Event]) -> list[Event]:
    if not events:
        return []
    t0 = min(e.start for e in events)
    moved = [replace(e, start=e.start - t0, end=e.end - t0) for e in events]
    return sorted(moved, key=lambda e: (e.rank, e.start))


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def bubble_fraction(events: list[Event]) -> float:
    """Measured idle share: ``1 - busy / (ranks * span)``.

    ``span`` runs from the earliest start to the latest end over all events; a rank's
    busy time is the union of its event intervals. Ranks are those that recorded at
    least one event.
    """
    if not events:
        raise ValueError("no events: nothing was recorded")
    span = max(e.end for e in events) - min(e.start for e in events)
    ranks = sorted({e.rank for e in events})
    if span <= 0:
        return 0.0
    busy = sum(_union_length([(e.start, e.end) for e in events if e.rank == r]) for r in ranks)
    return 1.0 - busy / (len(ranks) * span)


def theoretical_bubble(stages: int, microbatches: int, virtual: int = 1) -> float:
    """Idle share of an ideal GPipe / 1F1B schedule: ``(p-1) / (v*m + p-1)``.

    ``p`` pipeline ranks, ``m`` microbatches, ``v`` stages per rank (interleaved).
    """
    if stages < 1 or microbatches < 1 or virtual < 1:
        raise ValueError("stages, microbatches and virtual must be at least 1")
    return (stages - 1) / (virtual * microbatches + stages - 1)


@dataclass
class ScheduleRecording:
    """What every rank of a pipeline ran in the steps recorded by
    ``DistributedModel.record_schedule()``: events, grid, measured vs ideal bubble.

    Record one step: idle time between steps (the optimizer, data loading) counts as
    bubble too.
    """

    ranks: int
    microbatches: int
    virtual: int = 1
    events: list[Event] = field(default_factory=list)

    @property
    def bubble(self) -> float:
        """Measured idle share of the recorded span."""
        return bubble_fraction(self.events)

    @property
    def theoretical(self) -> float:
        """``(p-1) / (v*m + p-1)`` for this pipeline."""
        return theoretical_bubble(self.ranks, self.microbatches, self.virtual)

    def grid(self, width: int = 100) -> str:
        """The rank x time grid as text (see :func:`render_grid`)."""
        return render_grid(self.events, width)


def _symbol(event: Event) -> str:
    if event.kind == "F":
        return str(event.microbatch % 10)
    base = "a" if event.kind == "B" else "A"
    return chr(ord(base) + event.microbatch % 26)


def render_grid(events: list[Event], width: int = 100) -> str:
    """The schedule as text: one row per rank, time left to right in ``width`` columns.

    Each column shows what covered most of its time slice on that rank: a forward as the
    microbatch digit (``mb % 10``: ``0``-``9``), a backward as a lowercase letter (``a`` =
    mb 0, ``b`` = mb 1, ...), a weight-gradient backward as an uppercase letter (``A`` =
    mb 0, ...), idle as ``.``. An event too short to win any column is still drawn at its
    midpoint when that column is idle, so a row can look busier than it was; the bubble
    line is exact. Stages sharing a rank (interleaved schedules) are not told apart.
    Ideal GPipe, 2 ranks x 4 microbatches, unit-time F and B, ``width=40``::

        time 0 .. 10000.000 ms, 250.000 ms per column
        rank 0 |0000111122223333........aaaabbbbccccdddd|
        rank 1 |....0000111122223333aaaabbbbccccdddd....|
        legend: 0-9 forward of mb (mod 10), a-z backward of mb 0.., A-Z weight-grad ...
        bubble: 20.0% measured
    """
    if not events:
        raise ValueError("no events: nothing was recorded")
    if width < 1:
        raise ValueError("width must be at least 1")
    t0 = min(e.start for e in events)
    span = max(e.end for e in events) - t0
    step = span / width if span > 0 else 1.0
    ranks = sorted({e.rank for e in events})
    label = max(len(str(r)) for r in ranks)
    lines = [f"time 0 .. {span * 1e3:.3f} ms, {step * 1e3:.3f} ms per column"]
    for r in ranks:
        mine = [e for e in events if e.rank == r]
        cells: list[Event | None] = []
        for c in range(width):
            lo, hi = t0 + c * step, t0 + (c + 1) * step
            cover = [(min(e.end, hi) - max(e.start, lo), e) for e in mine]
            cover = [(t, e) for t, e in cover if t > 0]
            idle = (hi - lo) - _union_length([(max(e.start, lo), min(e.end, hi))
                                              for _, e in cover])
            best = max(cover, key=lambda te: te[0], default=None)
            cells.append(best[1] if best and best[0] >= idle else None)
        # an event shorter than a column would vanish: draw it where its midpoint falls
        shown = {id(e) for e in cells if e is not None}
        for e in mine:
            c = min(int(((e.start + e.end) / 2 - t0) / step), width - 1)
            if id(e) not in shown and cells[c] is None:
                cells[c] = e
        row = "".join("." if e is None else _symbol(e) for e in cells)
        lines.append(f"rank {r:>{label}} |{row}|")
    lines.append("legend: 0-9 forward of mb (mod 10), a-z backward of mb 0.., "
                 "A-Z weight-grad backward of mb 0.., . idle")
    lines.append(f"bubble: {bubble_fraction(events):.1%} measured")
    return "\n".join(lines)
