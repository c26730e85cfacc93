"""SMP v1's rank queries, process-group getters and object collectives per group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from modelparallel.smp.state import state
from modelparallel.topology import CommGroup, RankType

WORLD = CommGroup.WORLD
PP_GROUP = CommGroup.PP_GROUP
TP_GROUP = CommGroup.TP_GROUP
DP_GROUP = CommGroup.DP_GROUP
RDP_GROUP = CommGroup.RDP_GROUP
MP_GROUP = CommGroup.MP_GROUP

_CPU = torch.device("cpu")  # objects travel as CPU byte tensors (gloo on mixed backends)


def _rank_in(group: CommGroup) -> int:
    s = state.require(f"mp.{group.value}_rank()").context
    return s.topology.rank_in(s.rank, group)


def _size_of(group: CommGroup) -> int:
    return state.require(f"mp.{group.value}_size()").context.topology.size_of(group)


def rank() -> int:
    """Global rank of this process."""
    return state.require("mp.rank()").context.rank


def size() -> int:
    """Number of processes in the job."""
    return state.require("mp.size()").context.topology.world_size


def local_rank() -> int:
    """Rank of this process among the processes on its host."""
    return state.require("mp.local_rank()").context.local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return state.require("mp.local_size()").context.local_size


def pp_rank() -> int:
    """Pipeline stage of this process."""
    return _rank_in(PP_GROUP)


def pp_size() -> int:
    return _size_of(PP_GROUP)


def tp_rank() -> int:
    """Index of this process within its tensor-parallel group."""
    return _rank_in(TP_GROUP)


def tp_size() -> int:
    return _size_of(TP_GROUP)


def dp_rank() -> int:
    """Index within the data-parallel group (all ranks holding the same pipeline stage)."""
    return _rank_in(DP_GROUP)


def dp_size() -> int:
    return _size_of(DP_GROUP)


def rdp_rank() -> int:
    """Index within the reduced data-parallel group (same stage and same TP shard)."""
    return _rank_in(RDP_GROUP)


def rdp_size() -> int:
    return _size_of(RDP_GROUP)


def mp_rank() -> int:
    """Index within the model-parallel group (the ranks holding one model replica)."""
    return _rank_in(MP_GROUP)


def mp_size() -> int:
    return _size_of(MP_GROUP)


def get_process_group(group: CommGroup = WORLD) -> dist.ProcessGroup:
    """The torch.distributed ProcessGroup of this rank for ``group``."""
    return state.require("process groups").context.process_group(group)


def get_world_process_group() -> dist.ProcessGroup:
    return get_process_group(WORLD)


def get_pp_process_group() -> dist.ProcessGroup:
    return get_process_group(PP_GROUP)


def get_tp_process_group() -> dist.ProcessGroup:
    return get_process_group(TP_GROUP)


def get_dp_process_group() -> dist.ProcessGroup:
    return get_process_group(DP_GROUP)


def get_rdp_process_group() -> dist.ProcessGroup:
    return get_process_group(RDP_GROUP)


def get_mp_process_group() -> dist.ProcessGroup:
    return get_process_group(MP_GROUP)


def group_ranks(group: CommGroup) -> list[int]:
    """Global ranks of this process's ``group``, in group-rank order."""
    s = state.require("group ranks").context
    return s.topology.group_ranks(s.rank, group)


def get_mp_group() -> list[int]:
    """Ranks over which this model replica is partitioned."""
    return group_ranks(MP_GROUP)


def get_dp_group() -> list[int]:
    """Ranks holding replicas of this model partition."""
    return group_ranks(DP_GROUP)


def get_tp_group() -> list[int]:
    return group_ranks(TP_GROUP)


def get_pp_group() -> list[int]:
    return group_ranks(PP_GROUP)


def get_rdp_group() -> list[int]:
    return group_ranks(RDP_GROUP)


def barrier(group: CommGroup = WORLD) -> None:
    """Wait until every process of ``group`` reaches this point."""
    dist.barrier(group=get_process_group(group))


def dp_barrier() -> None:
    barrier(DP_GROUP)


def mp_barrier() -> None:
    barrier(MP_GROUP)


def allgather(obj: Any, group: CommGroup = WORLD) -> list[Any]:
    """Gather a picklable object from every rank of ``group``, in group-rank order."""
    out: list[Any] = [None] * _size_of(group)
    dist.all_gather_object(out, obj, group=get_process_group(group))
    return out


def broadcast(obj: Any, group: CommGroup = WORLD) -> None:
    """Send ``obj`` to every other rank of ``group``; they receive it with ``recv_from``."""
    me = rank()
    for peer in group_ranks(group):
        if peer != me:
            dist.send_object_list([obj], dst=peer, device=_CPU)


def send(obj: Any, dest_rank: int, rank_type: RankType) -> None:
    """Send ``obj`` to the rank whose ``rank_type`` rank is ``dest_rank`` in our group."""
    dist.send_object_list([obj], dst=_peer(dest_rank, rank_type), device=_CPU)


def recv_from(src_rank: int, rank_type: RankType) -> Any:
    """Receive an object sent by ``send`` or ``broadcast`` from a peer of our group."""
    box: list[Any] = [None]
    dist.recv_object_list(box, src=_peer(src_rank, rank_type), device=_CPU)
    return box[0]


def _peer(index: int, rank_type: RankType) -> int:
    members = group_ranks(rank_type.value)
    if not 0 <= index < len(members):
        raise ValueError(f"{rank_type.name} {index} does not exist; this process's "
                         f"{rank_type.value.name} has ranks 0..{len(members) - 1}")
    peer = members[index]
    if peer == rank():
        raise ValueError(f"{rank_type.name} {index} is this process itself")
    return peer
