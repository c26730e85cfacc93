"""Bubble arithmetic, grid drawing and stage patching of the pipeline schedule recorder."""

import pytest

from modelparallel.parallel.pipeline.record import (
    Event,
    ScheduleRecorder,
    bubble_fraction,
    gather_events,
    render_grid,
    theoretical_bubble,
)


def gpipe(ranks: int, microbatches: int) -> list[Event]:
    """An ideal GPipe step with unit-time F and B: all forwards, then all backwards."""
    events = []
    for r in range(ranks):
        for mb in range(microbatches):
            t = r + mb
            events.append(Event(r, r, "F", mb, t, t + 1))
            # backwards run from the last rank back: rank r starts after ranks above it
            t = microbatches + ranks - 1 + (ranks - 1 - r) + mb
            events.append(Event(r, r, "B", mb, t, t + 1))
    return events


@pytest.mark.parametrize("ranks,microbatches", [(2, 2), (2, 4), (4, 8)])
def test_gpipe_bubble_matches_theory(ranks, microbatches):
    got = bubble_fraction(gpipe(ranks, microbatches))
    assert got == pytest.approx(theoretical_bubble(ranks, microbatches))


def test_two_ranks_two_microbatches_is_one_third():
    assert bubble_fraction(gpipe(2, 2)) == pytest.approx(1 / 3)


def test_no_idle_time_is_no_bubble():
    events = [Event(0, 0, "F", 0, 0.0, 1.0), Event(1, 1, "F", 0, 0.0, 1.0)]
    assert bubble_fraction(events) == 0.0


def test_overlapping_events_count_once():
    # rank 0 busy on [0, 3) (overlap counted once), rank 1 on [0, 1) and [2, 4): span 4
    events = [Event(0, 0, "F", 0, 0.0, 2.0), Event(0, 0, "B", 0, 1.0, 3.0),
              Event(0, 0, "W", 0, 1.5, 2.5),
              Event(1, 1, "F", 0, 0.0, 1.0), Event(1, 1, "B", 0, 2.0, 4.0)]
    assert bubble_fraction(events) == pytest.approx(1 - (3 + 3) / (2 * 4))


def test_bubble_of_nothing_is_an_error():
    with pytest.raises(ValueError):
        bubble_fraction([])


def test_theoretical_bubble():
    assert theoretical_bubble(1, 8) == 0.0
    assert theoretical_bubble(2, 2) == pytest.approx(1 / 3)
    assert theoretical_bubble(4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble(4, 8, virtual=2) == pytest.approx(3 / 19)
    with pytest.raises(ValueError):
        theoretical_bubble(0, 8)


def test_grid_rows_and_characters():
    # 2 ranks x 2 microbatches on 6 time units, 2 columns per unit
    text = render_grid(gpipe(2, 2), width=12)
    lines = text.splitlines()
    rows = [line for line in lines if line.startswith("rank ")]
    assert rows == ["rank 0 |0011....aabb|",
                    "rank 1 |..0011aabb..|"]
    assert lines[-1] == "bubble: 33.3% measured"
    assert any(line.startswith("legend:") for line in lines)


def test_grid_symbols_for_weight_grads_and_large_microbatches():
    events = [Event(0, 0, "F", 12, 0.0, 1.0), Event(0, 0, "B", 12, 1.0, 2.0),
              Event(0, 0, "W", 12, 2.0, 3.0), Event(0, 0, "F", 0, 3.0, 4.0)]
    row = render_grid(events, width=4).splitlines()[1]
    assert row == "rank 0 |2mM0|"


def test_grid_shows_what_covers_most_of_a_column():
    # F0 fills column 0 and 30% of column 1, which is then mostly idle; B covers 60% -> B
    text = render_grid([Event(0, 0, "F", 0, 0.0, 1.3), Event(1, 1, "F", 0, 0.0, 2.0)], width=2)
    assert text.splitlines()[1] == "rank 0 |0.|"
    row = render_grid([Event(0, 0, "F", 0, 0.0, 0.4), Event(0, 0, "B", 0, 0.4, 1.0)],
                      width=1).splitlines()[1]
    assert row == "rank 0 |a|"


def test_grid_pads_rank_labels():
    events = [Event(r, r, "F", 0, float(r), r + 1.0) for r in range(11)]
    rows = [line for line in render_grid(events, width=11).splitlines()
            if line.startswith("rank")]
    assert len(rows) == 11
    assert rows[0].startswith("rank  0 |0") and rows[10].startswith("rank 10 |")
    assert len({len(row) for row in rows}) == 1


def test_gather_without_process_group_is_relative():
    events = [Event(0, 0, "B", 1, 12.0, 13.0), Event(0, 0, "F", 0, 10.0, 11.0)]
    got = gather_events(events)
    assert [(e.kind, e.start, e.end) for e in got] == [("F", 0.0, 1.0), ("B", 2.0, 3.0)]
    assert events[1].start == 10.0  # the caller's events are left alone
    assert gather_events([]) == []


class FakeStage:
    """The three compute methods a schedule calls on a stage."""

    stage_index = 3
    has_backward = True
    device = None

    def __init__(self):
        self.calls = []

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        self.calls.append(("F", fwd_chunk_id))
        return "out"

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True,
                           last_backward=False):
        self.calls.append(("B", bwd_chunk_id, full_backward))

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        self.calls.append(("W", bwd_chunk_id))


def test_recorder_wraps_and_restores_stage_methods():
    stage = FakeStage()
    with ScheduleRecorder([stage], rank=1) as recorder:
        assert "forward_one_chunk" in vars(stage)
        assert stage.forward_one_chunk(0, ()) == "out"
        stage.backward_one_chunk(0, loss=None, full_backward=False)
        stage.backward_weight_one_chunk(bwd_chunk_id=0)
        stage.forward_one_chunk(fwd_chunk_id=1, args=())
    assert not {"forward_one_chunk", "backward_one_chunk",
                "backward_weight_one_chunk"} & set(vars(stage))
    stage.forward_one_chunk(5, ())  # not recorded any more
    assert stage.calls == [("F", 0), ("B", 0, False), ("W", 0), ("F", 1), ("F", 5)]
    got = [(e.rank, e.stage, e.kind, e.microbatch) for e in recorder.events]
    assert got == [(1, 3, "F", 0), (1, 3, "B", 0), (1, 3, "W", 0), (1, 3, "F", 1)]
    assert all(e.start <= e.end for e in recorder.events)
    starts = [e.start for e in recorder.events]
    assert starts == sorted(starts)


def test_recorder_skips_backward_of_forward_only_steps():
    stage = FakeStage()
    stage.has_backward = False
    with ScheduleRecorder([stage], rank=0) as recorder:
        stage.forward_one_chunk(0, ())
        stage.backward_one_chunk(0)
    assert [e.kind for e in recorder.events] == ["F"]


def test_recorder_restores_on_error_and_refuses_nesting():
    stage = FakeStage()
    recorder = ScheduleRecorder([stage], rank=0)
    with pytest.raises(KeyError), recorder:
        with pytest.raises(RuntimeError), recorder:
            pass
        raise KeyError("boom")
    assert "forward_one_chunk" not in vars(stage)


def test_grid_keeps_events_shorter_than_a_column():
    # F0 takes 1% of the span: it wins no column but is drawn at its midpoint
    events = [Event(0, 0, "F", 0, 0.0, 0.01), Event(0, 0, "B", 0, 0.5, 1.0)]
    assert render_grid(events, width=4).splitlines()[1] == "rank 0 |0.aa|"
