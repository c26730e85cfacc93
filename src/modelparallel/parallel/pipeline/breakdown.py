"""Where a recorded pipeline step's time went, rank by rank, and the span its own
computations would have taken with nothing between them.

From the events of one recorded step (:mod:`record`) alone: every forward of stage
``s > 0`` needs the same microbatch's forward of stage ``s - 1`` (its activation),
every backward of a stage before the last needs the next stage's backward of that
microbatch (its gradient), and each rank runs its own events in the order recorded.
Between two events of a rank the time up to the moment the needed neighbour event
ended is a *dependency wait* (the schedule's bubble: the neighbour was still computing);
the rest of the gap is *overhead*: the message's latency (gloo, a socket on CPU) and
the Python between recorded ops (the schedule loop, the stage wrapper, the loss).
:func:`ideal_span` replays the same events with every gap cut to its dependency: the
span these computation times allow on this schedule, to which measured span is
compared (it also accounts for stages of unequal cost, which
``theoretical_bubble`` assumes away).
"""

from __future__ import annotations

from dataclasses import dataclass

from modelparallel.parallel.pipeline.record import Event, _union_length


@dataclass(frozen=True)
class RankTime:
    """One rank's share of a recorded step's span, in seconds (they add up to it).

    ``busy``: its recorded F/B/W; ``waiting``: idle until a neighbour's event it needs
    had ended (before its first event too); ``overhead``: idle after that (latency and
    Python outside the recorded ops); ``tail``: idle after its last event until the
    step's last event ended.
    """

    rank: int
    busy: float
    waiting: float
    overhead: float
    tail: float


def _producer(event: Event, by_key: dict[tuple[str, int, int], Event],
              stages: int) -> Event | None:
    """The event on a neighbouring stage whose output ``event`` consumes, if any."""
    if event.kind == "F" and event.stage > 0:
        return by_key.get(("F", event.stage - 1, event.microbatch))
    if event.kind == "B" and event.stage < stages - 1:
        return by_key.get(("B", event.stage + 1, event.microbatch))
    return None


def _rows(events: list[Event]) -> dict[int, list[Event]]:
    rows: dict[int, list[Event]] = {}
    for e in sorted(events, key=lambda e: e.start):
        rows.setdefault(e.rank, []).append(e)
    return rows


def time_split(events: list[Event]) -> list[RankTime]:
    """Per rank: busy, dependency wait, overhead and tail of the recorded span."""
    if not events:
        raise ValueError("no events: nothing was recorded")
    stages = 1 + max(e.stage for e in events)
    by_key = {(e.kind, e.stage, e.microbatch): e for e in events}
    t0 = min(e.start for e in events)
    t1 = max(e.end for e in events)
    split = []
    for rank, row in sorted(_rows(events).items()):
        waiting = overhead = 0.0
        reach = t0  # when this rank could have started its next event
        for e in row:
            if e.start > reach:
                producer = _producer(e, by_key, stages)
                ready = max(reach, min(producer.end, e.start)) if producer else reach
                waiting += ready - reach
                overhead += e.start - ready
            reach = max(reach, e.end)
        busy = _union_length([(e.start, e.end) for e in row])
        split.append(RankTime(rank, busy, waiting, overhead, t1 - reach))
    return split


def ideal_span(events: list[Event]) -> float:
    """The span of the same events, each rank in its recorded order, with every event
    starting as soon as its rank is free and its producer has ended: no latency, no
    work between events. Raises if the recorded order cannot be replayed."""
    if not events:
        raise ValueError("no events: nothing was recorded")
    stages = 1 + max(e.stage for e in events)
    by_key = {(e.kind, e.stage, e.microbatch): e for e in events}
    rows = _rows(events)
    end: dict[int, float] = {}  # id(event) -> replayed end
    free = dict.fromkeys(rows, 0.0)
    nxt = dict.fromkeys(rows, 0)
    left = len(events)
    while left:
        progressed = False
        for rank, row in rows.items():
            while nxt[rank] < len(row):
                e = row[nxt[rank]]
                producer = _producer(e, by_key, stages)
                if producer is not None and id(producer) not in end:
                    break
                start = max(free[rank], end[id(producer)] if producer else 0.0)
                free[rank] = end[id(e)] = start + (e.end - e.start)
                nxt[rank] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise ValueError("the recorded order of events cannot be replayed")
    return max(end.values())


def describe(events: list[Event]) -> str:
    """The split per rank in milliseconds and shares of the span, and the ideal span."""
    t0 = min(e.start for e in events)
    span = max(e.end for e in events) - t0
    ideal = ideal_span(events)
    busy = sum(r.busy for r in time_split(events))
    ranks = len({e.rank for e in events})
    lines = [f"span {span * 1e3:.1f} ms; these computations with nothing between them "
             f"{ideal * 1e3:.1f} ms (bubble {1 - busy / (ranks * ideal):.1%})"]
    for r in time_split(events):
        parts = [("busy", r.busy), ("dependency wait", r.waiting),
                 ("latency+python", r.overhead), ("tail", r.tail)]
        lines.append(f"rank {r.rank}: " + ", ".join(
            f"{name} {t * 1e3:.1f} ms ({t / span:.0%})" for name, t in parts))
    return "\n".join(lines)
