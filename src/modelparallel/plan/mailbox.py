"""Object collectives between simulated ranks.

``broadcast_object_list``, ``all_gather_object``, ``send_object_list`` and
``recv_object_list`` move Python objects the receiving rank uses (random states a
tensor-parallel group shares, the shapes pipeline stages exchange, a pipeline's
results); a fake process group moves nothing. ``ObjectMailbox`` carries them between
the ranks, which the planner simulates one after another: a rank receives what ranks
simulated before it sent; waiting for one not simulated yet raises ``NotYetSent`` and
the planner simulates it again after the others (a pipeline's first stage needs the
last stage's gradient shapes). An all-gather takes this rank's own object for the
ranks still to come (the ranks of a layout are alike).

Each call also issues, on the fake group, the tensor collectives torch's own function
would (a size tensor, then the pickled bytes), with the same shapes: the step's
collective bytes and memory count them as training does.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from modelparallel.plan.fake_world import (
    NotYetSent,
    group_or_world,
    is_fake,
    unset_fake_temporarily,
)

LONG, BYTE = torch.long, torch.uint8


class ObjectMailbox:
    """Object collectives between ranks simulated one after another (one per plan)."""

    def __init__(self) -> None:
        self._sent: dict[tuple[Any, ...], Any] = {}

    @contextlib.contextmanager
    def delivering(self, rank: int) -> Iterator[None]:
        """Route ``rank``'s object collectives through the mailbox while inside."""
        from torch.distributed import distributed_c10d

        calls: dict[tuple[Any, ...], int] = {}
        sent = self._sent

        def key(op: str, group: Any) -> tuple[Any, ...]:
            ranks = tuple(dist.get_process_group_ranks(group_or_world(group)))
            n = calls[(op, ranks)] = calls.get((op, ranks), 0) + 1
            return op, ranks, n

        def global_rank(group: Any, rank_: int | None, group_rank: int | None) -> int | None:
            if group_rank is not None:
                return dist.get_global_rank(group_or_world(group), group_rank)
            return rank_

        def broadcast_object_list(objects: list[Any], src: int | None = None,
                                  group: Any = None, device: Any = None,
                                  group_src: int | None = None) -> None:
            k = key("broadcast", group)
            src = global_rank(group, src, group_src)
            src = 0 if src is None else src
            if src == rank:
                sent[k] = list(objects)
            elif k in sent:
                objects[:] = sent[k]
            else:
                raise NotYetSent(f"rank {rank} waits for objects from rank {src}")
            sizes = [pickled_size(o) for o in objects]
            dist.broadcast(torch.empty(len(objects), dtype=LONG), src=src, group=group)
            dist.broadcast(torch.empty(sum(sizes), dtype=BYTE), src=src, group=group)

        def all_gather_object(out: list[Any], obj: Any, group: Any = None) -> None:
            k = key("all_gather", group)
            sent[(*k, rank)] = obj
            members = k[1]
            for i, member in enumerate(members):
                out[i] = sent.get((*k, member), obj)
            n, longest = len(members), max(pickled_size(o) for o in out)
            sizes = torch.zeros(n, dtype=LONG)
            dist.all_gather([sizes[i].unsqueeze(0) for i in range(n)], torch.zeros(1, dtype=LONG),
                            group=group)
            gathered = torch.empty(longest * n, dtype=BYTE)
            dist.all_gather([gathered[longest * i:longest * (i + 1)] for i in range(n)],
                            torch.empty(longest, dtype=BYTE), group=group)

        def send_object_list(objects: list[Any], dst: int | None = None, group: Any = None,
                             device: Any = None, group_dst: int | None = None,
                             use_batch: bool = False) -> None:
            dst = global_rank(group, dst, group_dst)
            sent[key(f"p2p {rank}->{dst}", group)] = list(objects)
            sizes = [pickled_size(o) for o in objects]
            dist.send(torch.empty(len(objects), dtype=LONG), dst=dst, group=group)
            dist.send(torch.empty(sum(sizes), dtype=BYTE), dst=dst, group=group)

        def recv_object_list(objects: list[Any], src: int | None = None, group: Any = None,
                             device: Any = None, group_src: int | None = None,
                             use_batch: bool = False) -> int:
            src = global_rank(group, src, group_src)
            k = key(f"p2p {src}->{rank}", group)
            if k not in sent:
                raise NotYetSent(f"rank {rank} waits for objects from rank {src}")
            objects[:] = sent[k]
            sizes = [pickled_size(o) for o in objects]
            dist.recv(torch.empty(len(objects), dtype=LONG), src=src, group=group)
            dist.recv(torch.empty(sum(sizes), dtype=BYTE), src=src, group=group)
            return int(src or 0)

        replaced = {"broadcast_object_list": broadcast_object_list,
                    "all_gather_object": all_gather_object,
                    "send_object_list": send_object_list,
                    "recv_object_list": recv_object_list}
        originals = {name: getattr(distributed_c10d, name) for name in replaced}
        for module in (dist, distributed_c10d):
            for name, fn in replaced.items():
                setattr(module, name, fn)
        try:
            yield
        finally:
            for module in (dist, distributed_c10d):
                for name, fn in originals.items():
                    setattr(module, name, fn)


class _SizingPickler(pickle.Pickler):
    """Pickles a fake tensor as a real one of its shape and dtype would be."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and is_fake(obj):
            with unset_fake_temporarily():
                real = torch.empty(obj.shape, dtype=obj.dtype)
            return real.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
        return NotImplemented


def pickled_size(obj: Any) -> int:
    """The bytes torch's object collectives send for ``obj`` (its pickle)."""
    buffer = io.BytesIO()
    _SizingPickler(buffer).dump(obj)
    return buffer.getbuffer().nbytes
