"""Topology: SMP's documented rank placement and process groups, as pure arithmetic."""

from __future__ import annotations

import itertools

import pytest

from modelparallel.config import Config, ConfigError
from modelparallel.topology import CommGroup, Topology

PERMUTATIONS = ["".join(p) for p in itertools.permutations("DPT")]


def topology(world_size: int, **config) -> Topology:
    return Topology.from_config(Config.load(config, environ={}), world_size)


def smp_ranks(topo: Topology, rank: int) -> tuple[int, int, int]:
    """(rdp_rank, pp_rank, tp_rank) of ``rank``, as SMP's tables list them."""
    return (topo.rank_in(rank, CommGroup.RDP_GROUP), topo.rank_in(rank, CommGroup.PP_GROUP),
            topo.rank_in(rank, CommGroup.TP_GROUP))


def expected_table(order: str, sizes: dict[str, int]) -> list[tuple[int, int, int]]:
    """SMP's rule, computed independently: the right-most letter varies fastest."""
    outer, middle, inner = order
    table = []
    for a in range(sizes[outer]):
        for b in range(sizes[middle]):
            for c in range(sizes[inner]):
                coords = {outer: a, middle: b, inner: c}
                table.append((coords["D"], coords["P"], coords["T"]))
    return table


class TestPlacement:
    """Ranks are laid out as SMP documents for every placement strategy."""

    # SMP's 8-GPU example, tp_size 2, pp_size 2, rdp_size 2: rank -> (rdp, pp, tp).
    DOCUMENTED = {
        "DPT": [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
                (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)],
        "PTD": [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1),
                (0, 1, 0), (1, 1, 0), (0, 1, 1), (1, 1, 1)],
    }

    @pytest.mark.parametrize("placement", ["DPT", "cluster", "PTD"])
    def test_documented_tables(self, placement):
        topo = topology(8, tensor_parallel_degree=2, pipeline_parallel_degree=2,
                        placement_strategy=placement)
        table = self.DOCUMENTED["DPT" if placement == "cluster" else placement]
        assert [smp_ranks(topo, r) for r in range(8)] == table

    def test_rule_reproduces_documented_tables(self):
        """The independent rule used below agrees with SMP's literal tables."""
        for order, table in self.DOCUMENTED.items():
            assert expected_table(order, {"D": 2, "P": 2, "T": 2}) == table

    @pytest.mark.parametrize("order", PERMUTATIONS)
    @pytest.mark.parametrize(("d", "p", "t"), [(2, 2, 2), (3, 4, 2), (2, 3, 5)])
    def test_every_permutation_follows_the_rule(self, order, d, p, t):
        world = d * p * t
        topo = topology(world, tensor_parallel_degree=t, pipeline_parallel_degree=p,
                        placement_strategy=order)
        assert topo.order == order
        table = expected_table(order, {"D": d, "P": p, "T": t})
        assert [smp_ranks(topo, r) for r in range(world)] == table

    @pytest.mark.parametrize(("name", "order"), [("cluster", "DPT"), ("spread", "TPD")])
    def test_named_strategies(self, name, order):
        kwargs = {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2}
        named = topology(8, placement_strategy=name, **kwargs)
        lettered = topology(8, placement_strategy=order, **kwargs)
        assert named.order == order
        assert [smp_ranks(named, r) for r in range(8)] == \
            [smp_ranks(lettered, r) for r in range(8)]

    def test_default_is_cluster(self):
        assert topology(8, tensor_parallel_degree=2).order == "DPT"


class TestGroupsWithoutTensorParallelism:
    """SMP's documented groups for 8 ranks, pipeline_parallel_degree 2, no tensor parallelism."""

    def test_spread(self):
        topo = topology(8, pipeline_parallel_degree=2, placement_strategy="spread")
        assert topo.all_groups(CommGroup.MP_GROUP) == [[0, 4], [1, 5], [2, 6], [3, 7]]
        assert topo.all_groups(CommGroup.DP_GROUP) == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert topo.rank_in(6, CommGroup.DP_GROUP) == 2
        assert [topo.rank_in(r, CommGroup.MP_GROUP) for r in range(8)] == [0] * 4 + [1] * 4

    def test_cluster(self):
        topo = topology(8, pipeline_parallel_degree=2, placement_strategy="cluster")
        assert topo.all_groups(CommGroup.MP_GROUP) == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert topo.all_groups(CommGroup.DP_GROUP) == [[0, 2, 4, 6], [1, 3, 5, 7]]
        assert [topo.rank_in(r, CommGroup.MP_GROUP) for r in range(8)] == [0, 1] * 4
        assert [topo.rank_in(r, CommGroup.DP_GROUP) for r in range(8)] == \
            [0, 0, 1, 1, 2, 2, 3, 3]


class TestGroups:
    """SMP's group semantics for tp 2 x pp 2 x rdp 2 with the "cluster" placement."""

    @pytest.fixture
    def topo(self) -> Topology:
        return topology(8, tensor_parallel_degree=2, pipeline_parallel_degree=2)

    @pytest.mark.parametrize(("group", "ranks"), [
        (CommGroup.WORLD, list(range(8))),
        (CommGroup.TP_GROUP, [0, 1]),
        (CommGroup.PP_GROUP, [0, 2]),
        (CommGroup.RDP_GROUP, [0, 4]),
        (CommGroup.DP_GROUP, [0, 1, 4, 5]),  # same pipeline stage: rdp x tp
        (CommGroup.MP_GROUP, [0, 1, 2, 3]),  # one model replica: pp x tp
    ])
    def test_groups_of_rank_0(self, topo, group, ranks):
        assert topo.group_ranks(0, group) == ranks

    @pytest.mark.parametrize(("group", "ranks"), [
        (CommGroup.TP_GROUP, [6, 7]),
        (CommGroup.PP_GROUP, [5, 7]),
        (CommGroup.RDP_GROUP, [3, 7]),
        (CommGroup.DP_GROUP, [2, 3, 6, 7]),
        (CommGroup.MP_GROUP, [4, 5, 6, 7]),
    ])
    def test_groups_of_rank_7(self, topo, group, ranks):
        assert topo.group_ranks(7, group) == ranks

    @pytest.mark.parametrize(("group", "size"), [
        (CommGroup.WORLD, 8), (CommGroup.TP_GROUP, 2), (CommGroup.PP_GROUP, 2),
        (CommGroup.RDP_GROUP, 2), (CommGroup.DP_GROUP, 4), (CommGroup.MP_GROUP, 4),
    ])
    def test_sizes(self, topo, group, size):
        assert topo.size_of(group) == size
        assert all(len(g) == size for g in topo.all_groups(group))

    @pytest.mark.parametrize("group", list(CommGroup))
    @pytest.mark.parametrize(("world", "config"), [
        (8, {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2}),
        (8, {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2,
             "placement_strategy": "PTD"}),
        (16, {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2,
              "placement_strategy": "spread"}),
        (24, {"tensor_parallel_degree": 3, "pipeline_parallel_degree": 2,
              "hybrid_shard_degree": 2, "placement_strategy": "TDP"}),
    ])
    def test_all_groups_partition_the_world(self, group, world, config):
        topo = topology(world, **config)
        groups = topo.all_groups(group)
        members = sorted(r for g in groups for r in g)
        assert members == list(range(world))  # every rank exactly once
        assert len(groups) == world // topo.size_of(group)
        for g in groups:
            assert g == sorted(g)
            for r in g:
                assert topo.group_ranks(r, group) == g
                assert topo.rank_in(r, group) == g.index(r)


class TestHybridSharding:
    """D expands to dp_replicate (outer) then dp_shard (inner)."""

    def test_hybrid_shard_degree_2(self):
        topo = topology(8, hybrid_shard_degree=2)
        assert (topo.dp_replicate, topo.dp_shard) == (4, 2)
        assert topo.group_ranks(0, ["dp_shard"]) == [0, 1]
        assert topo.group_ranks(0, ["dp_replicate"]) == [0, 2, 4, 6]
        assert topo.group_ranks(3, ["dp_shard"]) == [2, 3]
        assert topo.group_ranks(0, CommGroup.RDP_GROUP) == list(range(8))

    @pytest.mark.parametrize(("config", "replicate", "shard"), [
        ({"hybrid_shard_degree": 0}, 1, 8),
        ({}, 1, 8),
        ({"hybrid_shard_degree": 1}, 8, 1),
        ({"hybrid_shard_degree": 8}, 1, 8),
        ({"sharded_data_parallel_degree": 4}, 2, 4),
        ({"hybrid_shard_degree": 2, "tensor_parallel_degree": 2}, 2, 2),
    ])
    def test_replicate_and_shard_sizes(self, config, replicate, shard):
        topo = topology(8, **config)
        assert (topo.dp_replicate, topo.dp_shard) == (replicate, shard)
        assert topo.world_size == 8

    @pytest.mark.parametrize(("order", "dims"), [
        ("DPT", ("dp_replicate", "dp_shard", "pp", "tp")),
        ("PTD", ("pp", "tp", "dp_replicate", "dp_shard")),
        ("TDP", ("tp", "dp_replicate", "dp_shard", "pp")),
    ])
    def test_dim_order(self, order, dims):
        topo = topology(16, tensor_parallel_degree=2, pipeline_parallel_degree=2,
                        hybrid_shard_degree=2, placement_strategy=order)
        assert topo.dim_names == dims
        assert topo.shape == tuple({"dp_replicate": 2, "dp_shard": 2, "pp": 2, "tp": 2}[d]
                                   for d in dims)

    def test_shard_inside_replicate_with_tensor_parallelism(self):
        # DPT, rdp 4 = replicate 2 x shard 2, tp 2: rank = (rep * 2 + shard) * 2 + tp
        topo = topology(8, tensor_parallel_degree=2, hybrid_shard_degree=2)
        assert topo.group_ranks(0, ["dp_shard"]) == [0, 2]
        assert topo.group_ranks(0, ["dp_replicate"]) == [0, 4]
        assert topo.group_ranks(1, CommGroup.RDP_GROUP) == [1, 3, 5, 7]
        assert topo.coordinate(6) == {"dp_replicate": 1, "dp_shard": 1, "pp": 0, "tp": 0}


class TestCoordinates:
    """coordinate() and rank_at() are inverse; ranks outside the world are rejected."""

    @pytest.mark.parametrize(("world", "config"), [
        (1, {}),
        (8, {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2}),
        (24, {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 3,
              "hybrid_shard_degree": 2, "placement_strategy": "PDT"}),
    ])
    def test_round_trip(self, world, config):
        topo = topology(world, **config)
        seen = set()
        for rank in range(world):
            coords = topo.coordinate(rank)
            assert set(coords) == {"pp", "dp_replicate", "dp_shard", "tp"}
            assert all(0 <= coords[d] < topo.dim_size(d) for d in coords)
            assert topo.rank_at(coords) == rank
            seen.add(tuple(sorted(coords.items())))
        assert len(seen) == world  # distinct ranks have distinct coordinates

    @pytest.mark.parametrize("rank", [-1, 8, 100])
    def test_out_of_range_rank(self, rank):
        topo = topology(8, tensor_parallel_degree=2)
        with pytest.raises(ValueError, match=f"rank {rank} is outside a world of 8 ranks"):
            topo.coordinate(rank)
        with pytest.raises(ValueError):
            topo.group_ranks(rank, CommGroup.TP_GROUP)

    def test_from_config_checks_the_world_size(self):
        with pytest.raises(ConfigError) as info:
            topology(8, tensor_parallel_degree=3)
        assert info.value.keys == ["tensor_parallel_degree"]

    def test_describe(self):
        topo = topology(8, tensor_parallel_degree=2, pipeline_parallel_degree=2,
                        placement_strategy="spread")
        assert topo.describe() == \
            "8 ranks: tp=2 x pp=2 x dp_replicate=1 x dp_shard=2 (placement TPD)"
