"""The doctor's diagnoses from published states, without processes (the runs that
produce them are in tests/e2e/test_doctor.py)."""

from modelparallel.doctor import diagnose


def call(seq, op="all_reduce", shape="4", dtype="float32", site="t.py:10", group="0",
         ranks=(0, 1, 2), peer=None, start=0.0):
    return {"op": op, "group": group, "ranks": list(ranks), "seq": seq, "shape": shape,
            "dtype": dtype, "site": site, "start": start + seq, "peer": peer}


def state(rank, recent=(), current=None, done=False, failed=None):
    return {"rank": rank, "recent": list(recent), "current": current, "done": done,
            "failed": failed}


def test_the_rank_outside_the_majority_is_named():
    states = [state(0, [call(1)], call(2)), state(1, [call(1)], call(2, shape="2")),
              state(2, [call(1)], call(2))]
    text = diagnose.divergence(states)
    assert "collective #2 on group 0 (ranks 0, 1, 2)" in text
    assert "ranks 0, 2: all_reduce(4, float32) at t.py:10 (the others)" in text
    assert "rank 1: all_reduce(2, float32) at t.py:10 <- diverged" in text


def test_two_ranks_that_differ_are_both_named_without_blame():
    states = [state(0, current=call(1, ranks=(0, 1))),
              state(1, current=call(1, ranks=(0, 1), dtype="float64", site="t.py:12"))]
    text = diagnose.divergence(states)
    assert "diverged" in text and "<-" not in text and "t.py:12" in text


def test_agreeing_ranks_and_point_to_point_calls_are_not_divergence():
    same = [state(r, [call(1), call(2)]) for r in range(3)]
    assert diagnose.divergence(same) is None
    p2p = [state(0, current=call(1, op="send", peer=1, ranks=(0, 1))),
           state(1, current=call(1, op="recv", peer=0, ranks=(0, 1)))]
    assert diagnose.divergence(p2p) is None


def test_a_rank_that_finished_while_others_wait():
    waiting = state(0, [call(1), call(2, site="t.py:20")], call(3))
    done = state(1, [call(1), call(2, site="t.py:30")], done=True)
    text = diagnose.finished_early([waiting, done], me=0)
    assert "rank 0 waits in collective #3" in text and "rank 1 finished after 2 calls" in text
    assert "first difference: call #2: rank 0 all_reduce(4, float32) at t.py:20; " \
           "rank 1 all_reduce(4, float32) at t.py:30" in text
    assert diagnose.finished_early([waiting, state(1, [call(1)])], me=0) is None


def test_ranks_waiting_for_each_other_form_a_cycle():
    states = [state(0, current=call(1, op="recv", peer=1, site="t.py:5")),
              state(1, current=call(1, op="recv", peer=0, site="t.py:5")),
              state(2, current=call(1, op="barrier", shape="", group="9"))]
    text = diagnose.cycle(states)
    assert "rank 0 waits for rank 1 in recv(4, float32) from rank 1 at t.py:5" in text
    assert "rank 1 waits for rank 0" in text
    # a rank that is merely slow (not blocked in a call) is no cycle
    slow = [state(0, current=call(5, ranks=(0, 1))), state(1, [call(4, ranks=(0, 1))])]
    assert diagnose.cycle(slow) is None


def test_a_timeout_names_who_did_not_arrive_and_where_they_are():
    mine = call(2, site="t.py:11")
    states = [state(0, [call(1)], failed=mine), state(1, [call(1)]),
              state(2, [call(1)], current=call(2, site="t.py:11"))]
    stacks = {1: {"site": "t.py:10", "function": "train", "call": None}}
    text = diagnose.timed_out(mine, 0, states, stacks, 12)
    assert "rank 0 waited 12s in all_reduce(4, float32) at t.py:11 (collective #2" in text
    assert "rank 1 did not arrive: it is at t.py:10 in train()" in text
    assert "rank 2 arrived (waits too)" in text
    gone = diagnose.timed_out(mine, 0, states, {}, 12)
    assert "rank 1 did not arrive and did not answer" in gone


def test_a_rank_past_the_call_arrived_even_when_its_record_is_gone():
    """Rank 1 made the call long ago (its record left the last 32); rank 0 waits on it
    for rank 2. No cycle between 0 and 1."""
    states = [state(0, current=call(3, ranks=(0, 1, 2))),
              {**state(1, current=call(9, group="7", ranks=(0, 1))), "seqs": {"0": 5}},
              state(2, [call(2)])]
    assert diagnose.cycle(states) is None


def test_a_rank_that_finished_after_making_the_call_is_no_fault():
    slow = state(0, [call(1)], call(2))
    done = {**state(1, [call(1), call(2)], done=True), "seqs": {"0": 2}}
    assert diagnose.finished_early([slow, done], me=0) is None


def test_all_to_all_shapes_may_differ_by_design():
    states = [state(0, [call(1, op="all_to_all_single", shape="6")]),
              state(1, [call(1, op="all_to_all_single", shape="2")])]
    assert diagnose.divergence(states) is None
    states[1]["recent"][0]["dtype"] = "float64"
    assert "diverged" in diagnose.divergence(states)
