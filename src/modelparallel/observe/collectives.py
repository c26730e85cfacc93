"""Count the bytes every collective moves, per process group, as it runs.

A ``TorchDispatchMode`` sees each c10d and functional-collective op (FSDP, DDP,
DTensor and user calls alike) with its real tensors and process group. Bytes are
what a bandwidth-optimal (ring) algorithm sends from each rank — the "bus bytes" of
nccl-tests — so they compare directly with the textbook figures:
all-reduce ``2B(n-1)/n``, all-gather and reduce-scatter ``B(n-1)/n`` (B = the full,
unsharded tensor), broadcast and a send ``B`` (a receive is counted as a call of no
bytes: its bytes are the sender's). An all-to-all sends what leaves the rank: its input
but the part addressed to itself (``B(n-1)/n`` for even splits; the rows of other ranks'
splits for uneven ones, as expert parallelism's dispatch sends).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _ring(factor: float, arg: int) -> Callable[[Sequence, int], float]:
    """bytes = factor * B * (n-1)/n, B taken from positional argument ``arg``."""
    return lambda args, n: factor * _nbytes(args[arg]) * (n - 1) / n


def _whole(arg: int) -> Callable[[Sequence, int], float]:
    return lambda args, n: float(_nbytes(args[arg])) if n > 1 else 0.0


_C10D_BYTES = {  # op name -> (bytes(args, n), position of the ProcessGroup argument)
    "allreduce_": (_ring(2, 0), 1),
    "allreduce_coalesced_": (_ring(2, 0), 1),
    "_allgather_base_": (_ring(1, 0), 2),
    "allgather_": (_ring(1, 0), 2),
    "allgather_coalesced_": (_ring(1, 0), 2),
    "allgather_into_tensor_coalesced_": (_ring(1, 0), 2),
    "_reduce_scatter_base_": (_ring(1, 1), 2),
    "reduce_scatter_": (_ring(1, 1), 2),
    "reduce_scatter_tensor_coalesced_": (_ring(1, 1), 2),
    "alltoall_": (_ring(1, 1), 2),
    "alltoall_base_": (_ring(1, 1), 2),  # uneven splits: _alltoall_sent
    "broadcast_": (_whole(0), 1),
    "reduce_": (_whole(0), 1),
    "gather_": (_ring(1, 0), 2),
    "scatter_": (_ring(1, 1), 2),
    "send": (_whole(0), 1),
    # what a rank receives, its peer sends (and counts): a ring hop is B, not 2B
    "recv_": (lambda args, n: 0.0, 1),
    "recv_any_source_": (lambda args, n: 0.0, 1),
    "barrier": (lambda args, n: 0.0, 1),
    "monitored_barrier_": (lambda args, n: 0.0, 1),
}

_FUNCTIONAL_BYTES = {  # _c10d_functional op -> bytes(input bytes, n)
    "all_reduce": lambda b, n: 2 * b * (n - 1) / n,
    "all_reduce_coalesced": lambda b, n: 2 * b * (n - 1) / n,
    "all_gather_into_tensor": lambda b, n: b * (n - 1),  # input is one shard
    "all_gather_into_tensor_coalesced": lambda b, n: b * (n - 1),
    "reduce_scatter_tensor": lambda b, n: b * (n - 1) / n,
    "reduce_scatter_tensor_coalesced": lambda b, n: b * (n - 1) / n,
    "all_to_all_single": lambda b, n: b * (n - 1) / n,
    "broadcast": lambda b, n: float(b) if n > 1 else 0.0,
}


def _alltoall_sent(rows: torch.Tensor, splits: list[int], rank: int) -> float:
    """Bytes of ``rows`` an uneven all-to-all sends to other ranks (``splits[r]`` rows to
    rank ``r``; the rank's own split stays)."""
    row_bytes = _nbytes(rows) // max(rows.shape[0], 1) if rows.dim() else 0
    return float(row_bytes * (sum(splits) - splits[rank]))


class CollectiveCounter(TorchDispatchMode):
    """Use as a context manager; afterwards ``bytes`` and ``calls`` hold totals per group.

    ``labels`` maps process-group names to readable labels (``mp.state.group_labels``);
    unknown groups are labelled ``group<size>:<name>``.
    """

    def __init__(self, labels: dict[str, str] | None = None):
        super().__init__()
        self.labels = labels or {}
        self.bytes: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = func.namespace
        if ns == "c10d":
            self._count_c10d(func._opname, args)
        elif ns == "_c10d_functional":
            self._count_functional(func._opname, args)
        return func(*args, **kwargs)

    def _count_c10d(self, name: str, args: Sequence) -> None:
        entry = _C10D_BYTES.get(name)
        if entry is None:
            return
        size_of, pg_pos = entry
        pg = dist.ProcessGroup.unbox(args[pg_pos])
        if name == "alltoall_base_" and args[4]:  # input_split_sizes given
            self._add(pg.group_name, _alltoall_sent(args[1], list(args[4]), pg.rank()))
            return
        self._add(pg.group_name, size_of(args, pg.size()))

    def _count_functional(self, name: str, args: Sequence) -> None:
        size_of = _FUNCTIONAL_BYTES.get(name)
        if size_of is None:
            return
        pg = _resolve_process_group(args[-1])  # group_name is the last positional argument
        self._add(pg.group_name, size_of(_nbytes(args[0]), pg.size()))

    def _add(self, group_name: str, nbytes: float) -> None:
        label = self.labels.get(group_name)
        if label is None:
            pg = _resolve_process_group(group_name)  # type: ignore[arg-type]  # a GroupName is a str
            label = f"group{pg.size()}:{group_name}"
        self.bytes[label] += nbytes
        self.calls[label] += 1

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes.values())
