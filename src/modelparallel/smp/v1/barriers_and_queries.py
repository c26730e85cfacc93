"""SMP v1's smaller calls: group barriers, an object gather, the microbatch count,
whether the pipeline's tracing step is running, and shutdown."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from modelparallel.parallel.pipeline import trace
from modelparallel.smp.state import reset, state
from modelparallel.smp.v1.ranks import _size_of, barrier, get_process_group, group_ranks
from modelparallel.topology import CommGroup


def pp_barrier() -> None:
    barrier(CommGroup.PP_GROUP)


def tp_barrier() -> None:
    barrier(CommGroup.TP_GROUP)


def rdp_barrier() -> None:
    barrier(CommGroup.RDP_GROUP)


def gather(obj: Any, group: CommGroup = CommGroup.WORLD, rank: int = 0) -> list[Any] | None:
    """Gather a picklable object from every rank of ``group`` onto its rank ``rank`` (a
    group rank); returns the list there, None elsewhere. Collective over ``group``."""
    members = group_ranks(group)
    out: list[Any] | None = [None] * _size_of(group) if members[rank] == dist.get_rank() \
        else None
    dist.gather_object(obj, out, dst=members[rank], group=get_process_group(group))
    return out


def num_microbatches() -> int:
    """The ``microbatches`` of the configuration."""
    return state.require("smp.num_microbatches()").context.config.microbatches


def is_tracing() -> bool:
    """Whether this process is running the pipeline's tracing step (the first
    ``smp.step`` of a pipelined model measures each layer in a forward of its own)."""
    return trace.is_tracing()


def shutdown() -> None:
    """Forget the initialization and close the default process group."""
    reset()
    if dist.is_initialized():
        dist.destroy_process_group()
