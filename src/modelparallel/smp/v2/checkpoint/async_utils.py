"""``torch.sagemaker.distributed.checkpoint.async_utils``: the queue of checkpoints being
written in the background (``state_dict_saver.async_save(..., queue=...)``), in the
manner of Megatron-Core's ``AsyncCallsQueue`` that SMP's is built on."""

from __future__ import annotations

import concurrent.futures
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from modelparallel.smp.v2.checkpoint._common import collective_device


@dataclass
class _Call:
    index: int
    future: concurrent.futures.Future
    what: str


class AsyncCallsQueue:
    """Checkpoint saves in flight, oldest first.

    A call is *finalized* once its checkpoint is written and committed on every rank of
    its group; :meth:`maybe_finalize_async_calls` finalizes what is done and returns the
    indices of the calls it finalized. A failed save raises its
    :class:`~modelparallel.checkpoint.CheckpointError` there.
    """

    def __init__(self) -> None:
        self._calls: list[_Call] = []
        self._counter = itertools.count()

    def schedule_async_call(self, future: concurrent.futures.Future, what: str = "") -> int:
        """Add a background save (its future completes once it is committed); returns
        the call's index."""
        call = _Call(next(self._counter), future, what)
        self._calls.append(call)
        return call.index

    def get_num_unfinalized_calls(self) -> int:
        return len(self._calls)

    def maybe_finalize_async_calls(self, blocking: bool = False,
                                   process_group: dist.ProcessGroup | None = None,
                                   skip_sync: bool = False) -> list[int]:
        """Finalize the saves that are done, oldest first; return their indices.

        ``blocking``: wait for every save in the queue. Otherwise the ranks of
        ``process_group`` (default: the world) agree on how many of the oldest saves
        every one of them has finished (a collective: every rank of the group calls
        it), so all finalize the same calls; ``skip_sync=True`` decides on this rank
        alone, without a collective.
        """
        if blocking:
            count = len(self._calls)
        else:
            count = 0
            for call in self._calls:
                if not call.future.done():
                    break
                count += 1
            if not skip_sync and dist.is_initialized():
                count = _agree(count, process_group)
        finalized = []
        for _ in range(count):
            call = self._calls.pop(0)
            call.future.result()  # waits when blocking; raises the save's error
            finalized.append(call.index)
        return finalized

    def close(self) -> None:
        """Wait for every save in the queue (raising the first error)."""
        self.maybe_finalize_async_calls(blocking=True)


def _agree(count: int, group: dist.ProcessGroup | None) -> int:
    """The smallest ``count`` over the ranks of ``group``."""
    value = torch.tensor([count], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return int(value.item())


__all__ = ["AsyncCallsQueue"]
