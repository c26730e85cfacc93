"""SMP v2's ``tsm.state.ranker``: the replication groups of a layout (which ranks hold
the same shard of the model) and a rank's replica index, read from its topology."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from modelparallel.context import ParallelContext


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
