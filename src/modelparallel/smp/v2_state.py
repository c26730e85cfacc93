"""The attributes SMP v2 scripts read from ``tsm.state`` (docs/smp-compatibility.md).

:class:`V2Attributes` is mixed into the facade's ``State``: degrees, ranks and process
groups by SMP v2's names, the ``ranker`` of replication groups, and the activation
offloading settings. Context and expert parallelism are not built, so their degrees
are always 1, their rank 0 and their groups hold this rank alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from modelparallel.config import Config
from modelparallel.parallel.offload import loading_horizon
from modelparallel.smp.errors import NotInitializedError
from modelparallel.smp.rng_tracker import DEFAULT_NAME, RNGStateTracker
from modelparallel.topology import CommGroup

if TYPE_CHECKING:
    from modelparallel.context import ParallelContext

# Degrees a script may set on tsm.state before init() (SMP v2's shared scripts set them
# to 1 when they do not use SMP's implementation); init() applies them to the config.
SETTABLE_DEGREES = ("tensor_parallel_degree", "context_parallel_degree",
                    "expert_parallel_degree")


class Ranker:
    """SMP v2's ``tsm.state.ranker``: which ranks hold the same shard of the model.

    A replication group is the ranks that differ only in their data-parallel replica
    (the ``dp_replicate`` mesh dim); a rank's replication rank is its replica index.
    """

    def __init__(self, context: ParallelContext) -> None:
        self._topology = context.topology

    def get_rep_groups(self) -> list[list[int]]:
        """Every replication group, as lists of global ranks."""
        return self._topology.all_groups(("dp_replicate",))

    def get_rep_rank(self, rank: int | None = None) -> int:
        """The replica index of ``rank`` (default: this process's)."""
        if rank is None:
            rank = dist.get_rank()
        return self._topology.coordinate(rank)["dp_replicate"]

    def get_shard_groups(self) -> list[list[int]]:
        """Every group of ranks that share one replica's shards (FSDP's group)."""
        return self._topology.all_groups(("dp_shard",))


class V2Attributes:
    """SMP v2's ``tsm.state`` names, read from the current ParallelContext."""

    _context: ParallelContext | None
    _degree_overrides: dict[str, int]
    _singletons: dict[str, Any]
    set: Any  # State.set

    def _ctx(self, name: str) -> ParallelContext:
        if self._context is None:
            raise NotInitializedError(f"tsm.state.{name}")
        return self._context

    # sizes and degrees
    @property
    def world_size(self) -> int:
        return self._ctx("world_size").topology.world_size

    @property
    def hybrid_shard_degree(self) -> int:
        """The number of ranks each parameter is sharded over (SMP v2's degree after it
        resolved 0 to the full data-parallel width)."""
        return self._ctx("hybrid_shard_degree").topology.dp_shard

    @property
    def tensor_parallel_degree(self) -> int:
        if self._context is None:
            return self._degree_overrides.get("tensor_parallel_degree", 1)
        return self._context.topology.tp

    @tensor_parallel_degree.setter
    def tensor_parallel_degree(self, value: int) -> None:
        self._override("tensor_parallel_degree", value)

    @property
    def context_parallel_degree(self) -> int:
        if self._context is None:
            return self._degree_overrides.get("context_parallel_degree", 1)
        return self._context.config.context_parallel_degree

    @context_parallel_degree.setter
    def context_parallel_degree(self, value: int) -> None:
        self._override("context_parallel_degree", value)

    @property
    def expert_parallel_degree(self) -> int:
        if self._context is None:
            return self._degree_overrides.get("expert_parallel_degree", 1)
        return self._context.config.expert_parallel_degree

    @expert_parallel_degree.setter
    def expert_parallel_degree(self, value: int) -> None:
        self._override("expert_parallel_degree", value)

    def _override(self, key: str, value: int) -> None:
        if self._context is not None:
            raise RuntimeError(f"tsm.state.{key} cannot change after tsm.init(); set "
                               f"{key} in the configuration, or on tsm.state before init")
        self._degree_overrides[key] = int(value)

    def take_degree_overrides(self) -> dict[str, int]:
        """The degrees set on the state before init (init applies them, once)."""
        overrides, self._degree_overrides = self._degree_overrides, {}
        return overrides

    @property
    def tp_size(self) -> int:
        return self.tensor_parallel_degree

    @property
    def tp_rank(self) -> int:
        return self._ctx("tp_rank").coordinate("tp")

    @property
    def cp_size(self) -> int:
        return self.context_parallel_degree

    @property
    def cp_rank(self) -> int:
        self._ctx("cp_rank")
        return 0  # context parallelism is not built: the degree is 1

    @property
    def ep_size(self) -> int:
        return self.expert_parallel_degree

    @property
    def ep_rank(self) -> int:
        self._ctx("ep_rank")
        return 0  # expert parallelism is not built: the degree is 1

    @property
    def dp_rank(self) -> int:
        return self._ctx("dp_rank").topology.rank_in(dist.get_rank(), CommGroup.RDP_GROUP)

    @property
    def dp_size(self) -> int:
        return self._ctx("dp_size").topology.size_of(CommGroup.RDP_GROUP)

    # process groups
    @property
    def world_process_group(self) -> dist.ProcessGroup:
        self._ctx("world_process_group")
        world = dist.group.WORLD
        assert world is not None
        return world

    @property
    def tp_process_group(self) -> dist.ProcessGroup:
        return self._ctx("tp_process_group").process_group(CommGroup.TP_GROUP)

    @property
    def dp_process_group(self) -> dist.ProcessGroup:
        return self._ctx("dp_process_group").process_group(CommGroup.RDP_GROUP)

    @property
    def rep_rank_process_group(self) -> dist.ProcessGroup:
        """The ranks of this rank's replica that shard the model together (SMP v2: the
        devices with the same replication rank)."""
        return self._ctx("rep_rank_process_group").meshes["dp_shard"].get_group()

    @property
    def cp_process_group(self) -> dist.ProcessGroup:
        """This rank alone (context parallelism is not built). Made on first use by
        every rank together, like any process group."""
        return self._singleton("cp_process_group")

    @property
    def ep_process_group(self) -> dist.ProcessGroup:
        """This rank alone (expert parallelism is not built); made like cp's."""
        return self._singleton("ep_process_group")

    def _singleton(self, name: str) -> dist.ProcessGroup:
        self._ctx(name)
        if "group" not in self._singletons:
            # one group per rank, made collectively (new_subgroups is called by all ranks)
            group, _ = dist.new_subgroups(group_size=1)
            self._singletons["group"] = group
        return self._singletons["group"]

    def reset(self) -> None:
        """``tsm.state.reset()``: forget the initialization (as ``tsm.reset()``)."""
        self.set(None)

    @property
    def ranker(self) -> Ranker:
        return Ranker(self._ctx("ranker"))

    # activation offloading (SMP v2 names; docs/smp-compatibility.md)
    @property
    def sm_activation_offloading(self) -> bool:
        return self._ctx("sm_activation_offloading").config.sm_activation_offloading

    @property
    def activation_loading_horizon(self) -> int:
        """The configured horizon, or SMP v2's default (2) when none is set."""
        config = self._ctx("activation_loading_horizon").config
        return loading_horizon(config.activation_loading_horizon, v2=True)

    @property
    def cfg(self) -> Config:
        """SMP v1's name for the configuration (``smp.state.cfg.fp16``)."""
        return self._ctx("cfg").config

    def get_rng_state_tracker(self) -> RNGStateTracker:
        """The tracker of named random states that SMP v2 passes to activation
        checkpointing, with ``model-parallel-rng`` seeded by ``random_seed`` plus the
        tensor-parallel rank (made on first use after each init)."""
        context = self._ctx("get_rng_state_tracker")
        if "rng" not in self._singletons:
            tracker = RNGStateTracker()
            tracker.add(DEFAULT_NAME, context.config.random_seed + context.coordinate("tp"))
            self._singletons["rng"] = tracker
        return self._singletons["rng"]
