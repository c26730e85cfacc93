"""The planner with context parallelism: a cp rank's step simulated with its ring
attention on the fake process group (every key/value hop counted as the bytes it
sends), its peak, and the search recommending a cp layout exactly when a sequence does
not fit otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelparallel.plan import Workload, plan_job
from modelparallel.plan.cli import load_factory
from modelparallel.plan.device_model import PROFILES
from modelparallel.plan.search import search
from modelparallel.plan.table import ranking

# the example docs/planner.md plans, loaded as `--model` loads it
tiny_llama = load_factory(f"{Path(__file__).parents[2]}/examples/plan/models.py:tiny_llama")

SEQ = 1024
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16  # tiny_llama's
FLOAT32, INT64 = 4, 8


def ring_bytes(cp: int, rows: int = 1) -> float:
    """What rank 0 of a cp group sends per step: per layer, the key/value block (keys
    and values of its two chunks, in float32) goes cp - 1 hops forward, cp - 1 again in
    the backward, and its gradient cp hops; the labels are gathered once (int64) and the
    count of targets all-reduced (a float32 scalar)."""
    local = SEQ // cp
    block = 2 * rows * KV_HEADS * local * HEAD_DIM * FLOAT32
    hops = (cp - 1) + (cp - 1) + cp
    labels = (cp - 1) * rows * local * INT64
    count = 2 * FLOAT32 * (cp - 1) / cp
    return LAYERS * hops * block + labels + count


@pytest.fixture(scope="module")
def searched():
    """The layouts of 2 ranks for one sequence of SEQ tokens each, searched once."""
    device = PROFILES["h100"]
    work = Workload(tiny_llama, {}, world_size=2, batch_size=1, seq_len=SEQ)
    return search(work, device, memory_per_device=18 * 2**20), device


def by_degrees(found, shard: int, cp: int):
    return next(c for c in found if c.config["hybrid_shard_degree"] == shard
                and c.config["tensor_parallel_degree"] == 1
                and c.config["pipeline_parallel_degree"] == 1
                and c.config["context_parallel_degree"] == cp)


def check_rank(split, whole, cp: int, shard: int) -> None:
    """Rank 0's plan with ``cp`` against its plan without, both sharded over ``shard``."""
    # the parameters' all-gathers and reduce-scatters are the same (cp shards nothing
    # more); when the cp group is the shard group, they are counted under its label
    fsdp = whole.comm_bytes["dp_shard"]
    if cp == shard:
        assert split.comm_bytes == {"cp": ring_bytes(cp) + fsdp}, split.comm_bytes
    else:
        assert split.comm_bytes == {"cp": ring_bytes(cp), "dp_shard": fsdp}, split.comm_bytes
    assert split.param_bytes == whole.param_bytes
    assert split.activation_bytes < 0.7 * whole.activation_bytes, (split, whole)


def test_a_cp_rank_sends_its_ring_hops_and_holds_less(searched):
    found, _ = searched
    split, whole = by_degrees(found, 2, 2), by_degrees(found, 2, 1)
    check_rank(split.plan.ranks[0], whole.plan.ranks[0], cp=2, shard=2)


@pytest.mark.extended  # 35 s; the cp 2 case above counts the same ring in the default tier
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_bytes_of_larger_groups(cp):
    def plan(degree: int):
        config = {"hybrid_shard_degree": 4, "context_parallel_degree": degree}
        work = Workload(tiny_llama, config, world_size=4, batch_size=1, seq_len=SEQ, api="v2")
        return plan_job(work, [0]).ranks[0]

    check_rank(plan(cp), plan(1), cp=cp, shard=4)


def test_search_recommends_cp_when_the_sequence_does_not_fit_otherwise(searched):
    found, device = searched
    cp = [c for c in found if c.config["context_parallel_degree"] == 2]
    whole = [c for c in found if c.config["context_parallel_degree"] == 1 and c.plan]
    assert len(cp) == 1 and cp[0].refused is None and cp[0].plan is not None
    assert cp[0].plan.work.api == "v2", "context parallelism is planned with transform + shard"
    assert whole and all("> 18.00 MiB per device" in (c.refused or "") for c in whole)
    assert found[0] is cp[0]
    assert "best: pp 1, tp 1, hybrid_shard 2, cp 2" in ranking(found, device)
    # the group reads one sequence where two ranks alone would read two: with memory
    # enough, a layout without cp trains a sequence in less time and would come first
    assert cp[0].rows_per_step == 1 and all(c.rows_per_step == 2 for c in whole)
    assert min(c.seconds_per_row for c in whole) < cp[0].seconds_per_row
