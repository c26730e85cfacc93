"""Ranks that hold the same values: start them equal, keep their gradients equal.

- :func:`broadcast_from_first` makes every holder of a tensor start from the first
  holder's value (SMP v1 broadcasts the model from data-parallel rank 0 before the first
  step; scripts seed with ``seed + rank``). Run it before sharding.
- :func:`average_over_tp` is the FSDP2 hook that adds the tensor-parallel ranks to the
  average FSDP computes over the data-parallel mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from modelparallel.context import ParallelContext
from modelparallel.parallel import expert_parallel
from modelparallel.parallel.placement import is_meta
from modelparallel.topology import CommGroup


def broadcast_from_first(tensors: Iterable[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Overwrite ``tensors`` (this rank's parts) with the first rank of ``group``'s, one
    flat broadcast per dtype."""
    if dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0)
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.numel() and not is_meta(local):
            by_dtype.setdefault((local.dtype, local.device), []).append(local)
    with torch.no_grad():
        for parts in by_dtype.values():
            flat = torch.cat([p.detach().reshape(-1) for p in parts])
            dist.broadcast(flat, src=src, group=group)
            offset = 0
            for p in parts:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()


def synchronize(model: nn.Module, ctx: ParallelContext) -> None:
    """Every rank holding a part of ``model`` starts from the value of the first rank
    that holds the same part: tensor-parallel shards over the reduced data-parallel
    group, everything else over the data-parallel group (which includes the
    tensor-parallel ranks); the experts expert parallelism split over the ranks holding
    the same experts. Collective over the data-parallel group."""
    experts = {id(p): p for p in expert_parallel.expert_parameters(model)}
    split = [t for t in [*model.parameters(), *model.buffers()]
             if isinstance(t, DTensor) and id(t) not in experts]
    whole = [t for t in [*model.parameters(), *model.buffers()]
             if not isinstance(t, DTensor) and id(t) not in experts]
    broadcast_from_first(_unique(whole), ctx.process_group(CommGroup.DP_GROUP))
    if experts and ctx.expert_replicas_group is not None:
        broadcast_from_first(list(experts.values()), ctx.expert_replicas_group)
    if ctx.topology.tp > 1:
        broadcast_from_first(_unique(split), ctx.process_group(CommGroup.RDP_GROUP))


def _unique(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return list({id(t): t for t in tensors}.values())


def average_over_tp(ctx: ParallelContext) -> Callable[[torch.Tensor], None]:
    """FSDP2 all-reduce hook: after FSDP's average over the data-parallel mesh, average
    the reduced gradient over the tensor-parallel ranks too (replicas of a whole model)."""
    group = ctx.process_group(CommGroup.TP_GROUP)
    size = dist.get_world_size(group)

    def hook(reduced: torch.Tensor) -> None:
        dist.all_reduce(reduced, group=group)
        reduced.div_(size)

    return hook
