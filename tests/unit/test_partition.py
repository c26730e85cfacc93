"""Pipeline partitioning: automatic balancing, manual placement, and the partition table."""

import itertools
import random

import numpy as np
import pytest

from modelparallel.config import ConfigError
from modelparallel.parallel.pipeline.partition import (
    balance,
    describe,
    manual_starts,
)

NAMES = [f"blocks.{i}" for i in range(8)]


def stage_costs(starts, compute, memory, weight, before=(0.0, 0.0), after=(0.0, 0.0)):
    """The cost of every stage, computed independently of the module under test."""
    total_c = sum(compute) + before[0] + after[0]
    total_m = sum(memory) + before[1] + after[1]
    bounds = [*starts, len(compute)]
    costs = []
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        c, m = sum(compute[a:b]), sum(memory[a:b])
        if k == 0:
            c, m = c + before[0], m + before[1]
        if k == len(starts) - 1:
            c, m = c + after[0], m + after[1]
        costs.append((1 - weight) * (c / total_c if total_c else 0.0)
                     + weight * (m / total_m if total_m else 0.0))
    return costs


def brute_force(compute, memory, stages, weight, before, after):
    """Every split: the optimal bottleneck and the tie-broken choice among the optima."""
    n = len(compute)
    splits = [[0, *cuts] for cuts in itertools.combinations(range(1, n), stages - 1)]
    worst = {tuple(s): max(stage_costs(s, compute, memory, weight, before, after))
             for s in splits}
    opt = min(worst.values())
    tied = [s for s in splits if worst[tuple(s)] <= opt * (1 + 1e-9) + 1e-15]

    def evenness(s):
        counts = [b - a for a, b in itertools.pairwise([*s, n])]
        return sum(c * c for c in counts), s

    return opt, min(tied, key=evenness)


# -- balance ----------------------------------------------------------------------------

def test_equal_costs_split_evenly():
    assert balance([1.0] * 8, [1.0] * 8, 4, memory_weight=0.5) == [0, 2, 4, 6]
    assert balance([2.0] * 12, [5.0] * 12, 3, memory_weight=0.8) == [0, 4, 8]


def test_one_stage_and_one_layer_per_stage():
    assert balance([1.0, 9.0, 3.0], [1.0] * 3, 1, memory_weight=0.3) == [0]
    assert balance([1.0, 9.0, 3.0], [1.0] * 3, 3, memory_weight=0.3) == [0, 1, 2]


def test_skewed_compute():
    # One expensive layer gets a stage of its own; the rest share the other stages.
    assert balance([5.0, 1, 1, 1, 1, 1], [0.0] * 6, 2, memory_weight=0.0) == [0, 1]
    assert balance([1.0] * 6 + [6.0], [0.0] * 7, 3, memory_weight=0.0) == [0, 3, 6]


def test_memory_weight_picks_compute_or_memory_optimum():
    compute = [3.0, 1.0, 1.0, 1.0]  # compute alone: [3 | 1 1 1]
    memory = [1.0, 1.0, 1.0, 3.0]  # memory alone: [1 1 1 | 3]
    assert balance(compute, memory, 2, memory_weight=0.0) == [0, 1]
    assert balance(compute, memory, 2, memory_weight=1.0) == [0, 3]
    assert balance(compute, memory, 2, memory_weight=0.5) == [0, 2]  # costs 4 2 2 4


def test_before_and_after_costs_shift_the_boundaries():
    ones = [1.0] * 8
    assert balance(ones, ones, 2, memory_weight=0.0) == [0, 4]
    # An embedding worth 4 layers on stage 0: 4 + 2 | 6.
    assert balance(ones, ones, 2, memory_weight=0.0, before=(4.0, 0.0)) == [0, 2]
    # An LM head worth 4 layers on the last stage: 6 | 2 + 4.
    assert balance(ones, ones, 2, memory_weight=0.0, after=(4.0, 0.0)) == [0, 6]
    # Only the weighted dimension matters.
    assert balance(ones, ones, 2, memory_weight=0.0, before=(0.0, 100.0)) == [0, 4]
    assert balance(ones, ones, 2, memory_weight=1.0, before=(0.0, 4.0)) == [0, 2]


def test_zero_costs_give_the_most_even_split():
    # Nothing measured: every split ties, so layer counts decide, then the smallest starts.
    assert balance([0.0] * 8, [0.0] * 8, 3, memory_weight=0.5) == [0, 2, 5]
    assert balance([0.0] * 9, [0.0] * 9, 3, memory_weight=0.5) == [0, 3, 6]


def test_ties_prefer_even_layer_counts():
    # The heavy last layer fixes the bottleneck at 10; the four light layers could go
    # [1 | 3] or [2 | 2] or [3 | 1] ahead of it on 2 stages, all tying: even wins.
    compute = [1.0, 1.0, 1.0, 1.0, 10.0]
    assert balance(compute, [0.0] * 5, 3, memory_weight=0.0) == [0, 2, 4]


@pytest.mark.parametrize("seed", range(60))
def test_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    stages = rng.randint(1, n)
    # Small integers make exact ties common, which exercises the tie-breaking too.
    compute = [float(rng.randint(0, 5)) for _ in range(n)]
    memory = [float(rng.randint(0, 5)) for _ in range(n)]
    weight = rng.choice([0.0, 0.2, 0.5, 0.8, 1.0])
    before = (float(rng.randint(0, 6)), float(rng.randint(0, 6)))
    after = (float(rng.randint(0, 6)), float(rng.randint(0, 6)))
    starts = balance(compute, memory, stages, memory_weight=weight, before=before,
                     after=after)
    assert len(starts) == stages and starts[0] == 0
    assert all(a < b for a, b in itertools.pairwise(starts)) and starts[-1] < n
    opt, expected = brute_force(compute, memory, stages, weight, before, after)
    got = max(stage_costs(starts, compute, memory, weight, before, after))
    assert got == pytest.approx(opt, rel=1e-9, abs=1e-12)
    assert starts == expected


@pytest.mark.parametrize("seed", range(10))
def test_random_float_costs_against_brute_force(seed):
    rng = random.Random(1000 + seed)
    n, stages = rng.randint(4, 10), rng.randint(2, 4)
    compute = [rng.random() for _ in range(n)]
    memory = [rng.random() * 1e9 for _ in range(n)]  # bytes: a different scale
    starts = balance(compute, memory, stages, memory_weight=0.6, before=(0.3, 2e9))
    opt, _ = brute_force(compute, memory, stages, 0.6, (0.3, 2e9), (0.0, 0.0))
    got = max(stage_costs(starts, compute, memory, 0.6, (0.3, 2e9)))
    assert got == pytest.approx(opt, rel=1e-9)


def test_deterministic():
    rng = random.Random(7)
    compute = [rng.random() for _ in range(200)]
    memory = [rng.random() for _ in range(200)]
    first = balance(compute, memory, 8, memory_weight=0.8, before=(0.5, 3.0))
    for _ in range(3):
        assert balance(compute, memory, 8, memory_weight=0.8, before=(0.5, 3.0)) == first
    # Any sequence type gives the same answer.
    assert balance(tuple(compute), np.array(memory), 8, memory_weight=0.8,
                   before=(0.5, 3.0)) == first
    assert all(isinstance(s, int) for s in first)


def test_large_model_is_fast_enough():
    rng = random.Random(3)
    n = 2000
    compute = [rng.random() for _ in range(n)]
    memory = [rng.random() for _ in range(n)]
    starts = balance(compute, memory, 64, memory_weight=0.8, before=(0.0, n * 0.3))
    assert len(starts) == 64 and starts[0] == 0
    assert all(a < b for a, b in itertools.pairwise(starts))


def test_too_few_layers():
    with pytest.raises(ConfigError) as err:
        balance([1.0] * 3, [1.0] * 3, 4, memory_weight=0.8)
    assert err.value.keys == ["pipeline_parallel_degree"]
    msg = str(err.value)
    assert "3 layers" in msg and "4" in msg and "pipeline_parallel_degree <= 3" in msg


def test_bad_inputs():
    with pytest.raises(ValueError, match="memory has"):
        balance([1.0] * 3, [1.0] * 2, 2, memory_weight=0.5)
    with pytest.raises(ValueError, match="finite"):
        balance([1.0, -1.0], [1.0, 1.0], 2, memory_weight=0.5)
    with pytest.raises(ConfigError) as err:
        balance([1.0] * 3, [1.0] * 3, 2, memory_weight=1.5)
    assert err.value.keys == ["memory_weight"]


# -- manual placement -------------------------------------------------------------------

def test_manual_starts():
    assert manual_starts([0, 0, 1, 1, 1, 2, 2, 3], 4, 0, NAMES) == [0, 2, 5, 7]
    # Unplaced layers go to the default partition.
    assert manual_starts([0, 0] + [None] * 6, 2, 1, NAMES) == [0, 2]
    assert manual_starts([None] * 4 + [1] * 4, 2, 0, NAMES) == [0, 4]


def test_manual_not_contiguous():
    with pytest.raises(ConfigError) as err:
        manual_starts([0, 0, 1, 0, 1, 1, 1, 1], 2, 0, NAMES)
    assert err.value.keys == ["partition"]
    msg = str(err.value)
    assert "'blocks.3' (stage 0) runs after 'blocks.2' (stage 1)" in msg
    assert "contiguous runs of layers in execution order" in msg
    assert "every stage 0..1 must get at least one layer" in msg


def test_manual_empty_stage():
    with pytest.raises(ConfigError) as err:
        manual_starts([0, 0, 0, 0, 2, 2, 2, 2], 3, 0, NAMES)
    msg = str(err.value)
    assert err.value.keys == ["partition"]
    assert "stage 1 gets no layers" in msg
    assert "blocks.3 -> stage 0" in msg and "blocks.4 .. blocks.7 -> stage 2" in msg
    # The default partition filling everything leaves the other stages empty.
    with pytest.raises(ConfigError, match="stages 1, 2 get no layers") as err:
        manual_starts([None] * 8, 3, 0, NAMES)
    assert "default_partition=0" in str(err.value)


def test_manual_bad_stages():
    with pytest.raises(ConfigError) as err:
        manual_starts([0, 0, 5, 1], 2, 0, NAMES[:4])
    assert err.value.keys == ["partition"]
    assert "'blocks.2' (stage 5)" in str(err.value)
    with pytest.raises(ConfigError) as err:
        manual_starts([0, None, 1, 1], 2, 3, NAMES[:4])
    assert err.value.keys == ["default_partition"]
    with pytest.raises(ConfigError) as err:
        manual_starts([0, 1], 3, 0, NAMES[:2])
    assert err.value.keys == ["pipeline_parallel_degree"]


def test_unplaced_layers_keep_the_stages_contiguous():
    """Unplaced layers go to default_partition, moved to the nearest stage between the
    placed layers around them: an unplaced norm and head after a last block placed on
    the last stage follow it there; embeddings before the first placed block stay on 0."""
    names = ["embed", "pos", "b0", "b1", "b2", "b3", "norm", "head"]
    assert manual_starts([None, None, 0, 0, 0, 1, None, None], 2, 0, names) == [0, 5]
    assert manual_starts([None, None, 0, 1, 1, 1, None, None], 2, 1, names) == [0, 3]
    # between two placed layers on stages 1 and 2, default 0 becomes 1, default 3 becomes 2
    assert manual_starts([0, 1, None, 2, 3], 4, 0, names[:5]) == [0, 1, 3, 4]
    assert manual_starts([0, 1, None, 2, 3], 4, 3, names[:5]) == [0, 1, 2, 4]


# -- the table --------------------------------------------------------------------------

def test_describe():
    text = describe([0, 2, 5, 7], NAMES, [1.0] * 8, [2.0] * 8, ["embed"], ["norm", "head"])
    lines = text.splitlines()
    assert len(lines) == 2 + 4  # header, rule, one row per stage
    assert "embed + blocks.0 .. blocks.1" in lines[2]
    assert "blocks.2 .. blocks.4" in lines[3]
    assert "blocks.5 .. blocks.6" in lines[4]
    assert "blocks.7 + norm, head" in lines[5]
    for k, row in enumerate(lines[2:]):
        assert row.split()[0] == str(k)
    assert "25.0%" in lines[2] and "37.5%" in lines[3] and "12.5%" in lines[5]


def test_describe_names_runs_of_one_container_as_a_range():
    names = ["tok_emb", "pos_emb", "blocks.0", "blocks.1", "blocks.2", "ln_f", "lm_head"]
    rows = describe([0, 4], names, None, None, [], []).splitlines()[2:]
    assert "tok_emb, pos_emb + blocks.0 .. blocks.1" in rows[0]
    assert "blocks.2 + ln_f, lm_head" in rows[1]
    cnn = describe([0, 2], ["conv1", "conv2", "fc1", "fc2"], None, None, [], [])
    assert "conv1, conv2" in cnn and "fc1, fc2" in cnn


def test_describe_with_outer_costs_and_unknown_costs():
    text = describe([0, 4], NAMES, [1.0] * 8, None, [], ["head"], after=(8.0, 0.0))
    rows = text.splitlines()[2:]
    assert "25.0%" in rows[0] and "75.0%" in rows[1]  # head's compute on the last stage
    assert rows[0].rstrip().endswith("-")  # no memory measured
    single = describe([0], NAMES, None, None, ["embed"], ["head"])
    assert "embed + blocks.0 .. blocks.7 + head" in single
