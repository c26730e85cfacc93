"""``tsm.ranker``: the replication ranks of the current ``init()`` (``tsm.state.ranker``)."""

from __future__ import annotations

from modelparallel.smp.state import state


def get_rep_rank(rank: int | None = None) -> int:
    """The data-parallel replica index of ``rank`` (default: this process's)."""
    return state.ranker.get_rep_rank(rank)


def get_rep_groups() -> list[list[int]]:
    """Every group of ranks holding the same shard of the model."""
    return state.ranker.get_rep_groups()


def get_shard_groups() -> list[list[int]]:
    """Every group of ranks sharing one replica's shards."""
    return state.ranker.get_shard_groups()
