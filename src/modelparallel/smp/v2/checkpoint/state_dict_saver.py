"""``torch.sagemaker.distributed.checkpoint.state_dict_saver``: SMP v2's ``save`` and
``async_save`` on ``torch.distributed.checkpoint`` (DCP).

They take SMP's arguments and mean what they mean there, with these rules:

- ``checkpoint_id`` (a directory or an fsspec URL) is committed atomically: written under
  a hidden name and renamed once every rank of the group has finished
  (:func:`modelparallel.checkpoint.dcp.save`). With a ``storage_writer`` instead
  (e.g. :class:`~.filesystem.DistributedFileSystemWriter`), DCP writes into it directly,
  as SMP does, and its ``post_write_hooks`` run once the checkpoint is complete.
- ``process_group``: the ranks that save together (default: the world); only they
  call. ``coordinator_rank`` is a global rank: the group's first (``min(ranks)``).
- ``async_save`` returns once the state is copied to memory; writing and committing run
  in the background on a gloo group of the same ranks. The call joins ``queue``
  (default :data:`DEFAULT_ASYNC_REQUEST_QUEUE`); :func:`maybe_finalize_async_calls`
  waits for it. Wait before saving to the same place again.
- ``force_check_all_plans=False`` and ``wait_error_handling=False`` have no effect
  (one line says so): every save plans across all its ranks, and an error on any rank
  is raised on every rank.
- ``s3_region`` is handed to s3fs for an ``s3://`` location; ``s3client_config``
  (s3torchconnector's) is refused.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint import SavePlanner, StorageWriter

from modelparallel.checkpoint import dcp, guard
from modelparallel.smp.state import state
from modelparallel.smp.v2.checkpoint._common import check_coordinator, s3_region_for, say_once
from modelparallel.smp.v2.checkpoint.async_utils import AsyncCallsQueue
from modelparallel.smp.v2.checkpoint.filesystem import DistributedFileSystemWriter

DEFAULT_ASYNC_REQUEST_QUEUE = AsyncCallsQueue()
"""The queue ``async_save`` uses when given none."""


class PyTorchDistSaveShardedStrategy:
    """SMP's (and the only) sharded save strategy: DCP's own writer, every rank writing
    what it holds. ``async_save(sharded_strategy=...)`` accepts it or None."""


def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
         storage_writer: StorageWriter | None = None, planner: SavePlanner | None = None,
         process_group: dist.ProcessGroup | None = None, coordinator_rank: int = 0,
         wait_error_handling: bool = True, force_check_all_plans: bool = True,
         s3_region: str | None = None, s3client_config: Any = None) -> None:
    """Save ``state_dict`` like ``torch.distributed.checkpoint.save`` (every rank of
    ``process_group`` writes what it holds; collective over that group). See the
    module's notes for the arguments."""
    writer = _prepare("save", checkpoint_id, storage_writer, process_group, coordinator_rank,
                      wait_error_handling, force_check_all_plans, s3_region, s3client_config)
    if writer is None:
        assert checkpoint_id is not None  # _prepare returns a writer otherwise
        dcp.save(state_dict, checkpoint_id=checkpoint_id, ctx=state.context_or_none(),
                 planner=planner, process_group=process_group)
        return
    _guard("save", writer, process_group)
    dcp.run_dcp(torch_dcp.save, state_dict, context=f"saving {writer_path(writer)} failed",
                storage_writer=writer, planner=planner, process_group=process_group)
    _after(writer)()


def async_save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
               storage_writer: StorageWriter | None = None, planner: SavePlanner | None = None,
               process_group: dist.ProcessGroup | None = None, coordinator_rank: int = 0,
               queue: AsyncCallsQueue | None = None, sharded_strategy: Any = None,
               wait_error_handling: bool = True, force_check_all_plans: bool = True,
               s3_region: str | None = None, s3client_config: Any = None) -> None:
    """Like :func:`save`, but return once the state is copied to CPU memory; the
    checkpoint is written and committed in the background. The call joins ``queue``
    (default :data:`DEFAULT_ASYNC_REQUEST_QUEUE`): ``queue.maybe_finalize_async_calls``
    (or this module's :func:`maybe_finalize_async_calls`) waits for it and raises its
    error."""
    if sharded_strategy is not None and not isinstance(sharded_strategy,
                                                       PyTorchDistSaveShardedStrategy):
        raise TypeError(f"async_save: sharded_strategy must be None or a "
                        f"PyTorchDistSaveShardedStrategy (DCP's writer), not "
                        f"{type(sharded_strategy).__name__}")
    if queue is not None and not isinstance(queue, AsyncCallsQueue):
        raise TypeError(f"async_save: queue must be an AsyncCallsQueue, not "
                        f"{type(queue).__name__}")
    writer = _prepare("async_save", checkpoint_id, storage_writer, process_group,
                      coordinator_rank, wait_error_handling, force_check_all_plans, s3_region,
                      s3client_config)
    ctx = state.context_or_none()
    if writer is None:
        future = dcp.async_save(state_dict, checkpoint_id=checkpoint_id, ctx=ctx,
                                planner=planner, process_group=process_group)
        what = os.fspath(checkpoint_id)  # type: ignore[arg-type]
    else:
        future = dcp.async_save(state_dict, ctx=ctx, storage_writer=writer, planner=planner,
                                process_group=process_group, after=_after(writer))
        what = writer_path(writer)
    (queue or DEFAULT_ASYNC_REQUEST_QUEUE).schedule_async_call(future, what)


def maybe_finalize_async_calls(blocking: bool = True,
                               process_group: dist.ProcessGroup | None = None) -> list[int]:
    """Finalize the finished saves of :data:`DEFAULT_ASYNC_REQUEST_QUEUE` (all of them,
    waiting, when ``blocking``); returns their indices. See
    :meth:`AsyncCallsQueue.maybe_finalize_async_calls`."""
    return DEFAULT_ASYNC_REQUEST_QUEUE.maybe_finalize_async_calls(blocking=blocking,
                                                                  process_group=process_group)


def writer_path(writer: StorageWriter) -> str:
    return str(getattr(writer, "path", type(writer).__name__))


def _prepare(what: str, checkpoint_id: str | os.PathLike | None,
             storage_writer: StorageWriter | None, process_group: dist.ProcessGroup | None,
             coordinator_rank: int, wait_error_handling: bool, force_check_all_plans: bool,
             s3_region: str | None, s3client_config: Any) -> StorageWriter | None:
    """Check the arguments (before any collective); the writer to use, or None for the
    atomic ``checkpoint_id`` path."""
    if checkpoint_id is None and storage_writer is None:
        raise ValueError(f"{what}: pass checkpoint_id or storage_writer")
    check_coordinator(process_group, coordinator_rank, what)
    if not wait_error_handling:
        say_once("wait_error_handling", f"{what}: wait_error_handling=False has no effect: a "
                                        f"save's error is raised on every rank of its group")
    if not force_check_all_plans:
        say_once("force_check_all_plans", f"{what}: force_check_all_plans=False has no "
                                          f"effect: every save plans across all its ranks")
    region = s3_region_for(checkpoint_id or writer_path(storage_writer),  # type: ignore[arg-type]
                           s3_region, s3client_config, what)
    if storage_writer is not None:
        if checkpoint_id is not None:
            storage_writer.reset(checkpoint_id)  # DCP's meaning: write there
        return storage_writer
    if region is not None:  # s3 with a region: s3fs needs it; a copy is no atomic commit
        return DistributedFileSystemWriter(checkpoint_id, s3_region=region)  # type: ignore[arg-type]
    return None


def _guard(what: str, writer: StorageWriter, process_group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized() and process_group in (None, dist.group.WORLD):
        guard.check_every_rank_calls(f"{what}({writer_path(writer)!r})", state.context_or_none())


def _after(writer: StorageWriter):
    def run() -> None:
        if isinstance(writer, DistributedFileSystemWriter):
            writer.run_post_write_hooks()
    return run


__all__ = ["DEFAULT_ASYNC_REQUEST_QUEUE", "PyTorchDistSaveShardedStrategy", "async_save",
           "maybe_finalize_async_calls", "save"]
