"""The time split of a recorded pipeline step (parallel/pipeline/breakdown.py)."""

import pytest

from modelparallel.parallel.pipeline.breakdown import describe, ideal_span, time_split
from modelparallel.parallel.pipeline.record import Event, bubble_fraction, theoretical_bubble


def gpipe(latency: float, f: float = 1.0, b: float = 2.0) -> list[Event]:
    """GPipe, 2 ranks x 2 microbatches, every message ``latency`` late."""
    f0, f1 = (0, f), (f, 2 * f)
    g0 = (f0[1] + latency, f0[1] + latency + f)
    g1 = (max(g0[1], f1[1] + latency), max(g0[1], f1[1] + latency) + f)
    c0 = (g1[1], g1[1] + b)
    c1 = (c0[1], c0[1] + b)
    b0 = (c0[1] + latency, c0[1] + latency + b)
    b1 = (max(b0[1], c1[1] + latency), max(b0[1], c1[1] + latency) + b)
    return [Event(0, 0, "F", 0, *f0), Event(0, 0, "F", 1, *f1),
            Event(1, 1, "F", 0, *g0), Event(1, 1, "F", 1, *g1),
            Event(1, 1, "B", 0, *c0), Event(1, 1, "B", 1, *c1),
            Event(0, 0, "B", 0, *b0), Event(0, 0, "B", 1, *b1)]


def test_no_gaps_is_the_ideal():
    events = gpipe(0.0)
    span = max(e.end for e in events)
    assert ideal_span(events) == pytest.approx(span)
    assert bubble_fraction(events) == pytest.approx(theoretical_bubble(2, 2))
    for r in time_split(events):
        assert r.overhead == pytest.approx(0.0)
        assert r.busy == pytest.approx(6.0)
        assert r.busy + r.waiting + r.overhead + r.tail == pytest.approx(span)


def test_latency_is_overhead_not_dependency():
    events = gpipe(0.25)
    span = max(e.end for e in events)
    assert ideal_span(events) == pytest.approx(9.0)  # (m + p - 1) x (f + b)
    assert span == pytest.approx(9.0 + 2 * 0.25)  # the first activation, the last gradient
    split = {r.rank: r for r in time_split(events)}
    assert split[1].waiting == pytest.approx(1.0)  # rank 1 waits for stage 0's first F
    assert split[1].overhead == pytest.approx(0.25)  # its first activation's latency
    assert split[0].overhead == pytest.approx(0.25)  # the first gradient's latency
    for r in split.values():
        assert r.busy + r.waiting + r.overhead + r.tail == pytest.approx(span)
    assert "rank 1: busy 6000.0 ms" in describe(events)


def test_work_between_events_without_a_message_is_overhead():
    events = gpipe(0.0)
    # the loss on the last stage between its forwards and its first backward
    moved = [Event(e.rank, e.stage, e.kind, e.microbatch, e.start + 0.5, e.end + 0.5)
             if e.kind == "B" else e for e in events]
    split = {r.rank: r for r in time_split(moved)}
    assert split[1].overhead == pytest.approx(0.5)
    assert split[0].overhead == pytest.approx(0.0)  # it waited for rank 1's backward
    assert split[0].waiting == pytest.approx(3.5)


def test_an_order_that_cannot_be_replayed():
    # rank 0 runs the backward (which needs rank 1's) before the forward rank 1 needs
    events = [Event(0, 0, "B", 0, 0, 1), Event(1, 1, "F", 0, 0, 1),
              Event(0, 0, "F", 0, 1, 2), Event(1, 1, "B", 0, 1, 2)]
    with pytest.raises(ValueError, match="cannot be replayed"):
        ideal_span(events)
