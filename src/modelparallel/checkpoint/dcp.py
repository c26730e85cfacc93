"""``mp.checkpoint.save/load/async_save``: torch.distributed.checkpoint (DCP), with
fsspec URLs, safe loading, a check that every rank takes part, readable errors, and
an atomic commit (the checkpoint appears under its name only once complete)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import os
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint import LoadPlanner, SavePlanner, StorageReader, StorageWriter

from modelparallel.checkpoint import guard
from modelparallel.checkpoint.staging import ReusedStaging
from modelparallel.checkpoint.storage import (
    CheckpointError,
    Location,
    SafeLoadPlanner,
    reader_for,
    writer_for,
)
from modelparallel.context import ParallelContext


def _world(process_group) -> bool:
    return dist.is_initialized() and process_group in (None, dist.group.WORLD)


def _split(checkpoint_id: str | os.PathLike) -> tuple[Location, str]:
    path = os.fspath(checkpoint_id).rstrip("/")
    parent, _, name = path.rpartition("/") if "://" in path else \
        (os.path.dirname(os.path.abspath(path)), "", os.path.basename(path))
    return Location(parent), name


def _coordinator(process_group) -> int:
    """Global rank of the group's first rank (DCP's coordinator)."""
    return dist.get_global_rank(process_group, 0) if process_group is not None else 0


def temporary_name(name: str, process_group=None) -> str:
    """A hidden name next to ``name`` to write into, the same on every rank."""
    stamp = [f"{time.time_ns():x}-{os.getpid()}"]
    if dist.is_initialized():
        dist.broadcast_object_list(stamp, src=_coordinator(process_group), group=process_group)
    return f".tmp-{name}-{stamp[0]}"


def on_coordinator(fn, process_group=None, no_dist: bool = False) -> None:
    """Run ``fn`` on the group's first rank; its error is raised on every rank."""
    error: list[str | None] = [None]
    if no_dist or not dist.is_initialized() or dist.get_rank(process_group) == 0:
        try:
            fn()
        except CheckpointError as e:
            error[0] = str(e)
        except Exception as e:
            error[0] = f"{type(e).__name__}: {e}"
    distributed = dist.is_initialized() and not no_dist
    if distributed:
        dist.broadcast_object_list(error, src=_coordinator(process_group), group=process_group)
    if error[0]:
        first = not distributed or dist.get_rank(process_group) == 0
        raise CheckpointError(error[0] if first else
                              f"on rank {_coordinator(process_group)}: {error[0]}")


def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike,
         ctx: ParallelContext | None, storage_writer: StorageWriter | None = None,
         planner: SavePlanner | None = None,
         process_group: dist.ProcessGroup | None = None, no_dist: bool = False) -> Any:
    """Save ``state_dict`` like ``torch.distributed.checkpoint.save`` (every rank writes
    what it holds), committed atomically: written under a hidden name, renamed to
    ``checkpoint_id`` once every rank has finished. ``checkpoint_id`` is a directory
    or an fsspec URL. Returns DCP's metadata. ``ctx``: the layout (None before
    ``mp.init``, for one process)."""
    if storage_writer is not None:  # the caller chose the storage: plain DCP
        return torch_dcp.save(state_dict, storage_writer=storage_writer, planner=planner,
                              process_group=process_group, no_dist=no_dist)
    if _world(process_group) and not no_dist:
        guard.check_every_rank_calls(f"mp.checkpoint.save({os.fspath(checkpoint_id)!r})", ctx)
    location, name = _split(checkpoint_id)
    tmp = temporary_name(name, None if no_dist else process_group)
    try:
        metadata = run_dcp(torch_dcp.save, state_dict,
                           storage_writer=writer_for(location.url(tmp)), planner=planner,
                           process_group=process_group, no_dist=no_dist)
        commit_directory(location, tmp, name, process_group, no_dist)
    except BaseException:
        discard(location, tmp)
        raise
    return metadata


def discard(location: Location, tmp: str) -> None:
    """Remove what a failed save wrote (a full disk must not stay full); every rank
    tries, and one that finds it gone already goes on."""
    with contextlib.suppress(OSError):
        location.remove(tmp)


def commit_directory(location: Location, tmp: str, name: str, process_group=None,
                     no_dist: bool = False) -> None:
    """Rename ``tmp`` to ``name`` on the coordinator (replacing an older ``name``), then
    let every rank go on."""
    def commit() -> None:
        try:
            replace_directory(location, tmp, name)
        except Exception as e:
            raise CheckpointError(f"committing {location.url(name)} failed: {e}") from e

    on_coordinator(commit, process_group, no_dist)


def replace_directory(location: Location, tmp: str, name: str) -> None:
    old = None
    if location.exists(name):
        old = f".old-{tmp[len('.tmp-'):]}"
        location.rename(name, old)
    location.rename(tmp, name)
    if old:
        location.remove(old)


def load(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike,
         ctx: ParallelContext | None, storage_reader: StorageReader | None = None,
         planner: LoadPlanner | None = None,
         process_group: dist.ProcessGroup | None = None, no_dist: bool = False) -> None:
    """Load into ``state_dict`` in place like ``torch.distributed.checkpoint.load``,
    resharding to the layout of its tensors; non-tensor entries are loaded with
    ``torch.load(weights_only=True)``."""
    if _world(process_group) and not no_dist:
        guard.check_every_rank_calls(f"mp.checkpoint.load({os.fspath(checkpoint_id)!r})", ctx)
    run_dcp(torch_dcp.load, state_dict, context=f"reading {os.fspath(checkpoint_id)} failed",
            storage_reader=storage_reader or reader_for(checkpoint_id),
            planner=planner or SafeLoadPlanner(), process_group=process_group, no_dist=no_dist)


_async_groups: dict[Any, dist.ProcessGroup] = {}
_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                  thread_name_prefix="mp-checkpoint-commit")


def async_save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
               ctx: ParallelContext | None, storage_writer: StorageWriter | None = None,
               planner: SavePlanner | None = None,
               process_group: dist.ProcessGroup | None = None,
               after: Callable[[], None] | None = None) -> concurrent.futures.Future:
    """Like :func:`save`, but return as soon as the state is copied to CPU memory; the
    writing and the commit run in the background. The returned future completes on
    every rank once the checkpoint is committed (and ``after()`` ran, in the
    background); wait for it before the next save. With a ``storage_writer`` the
    caller chose the storage: plain DCP into it, no commit.

    The background collectives run on a separate gloo group, so they never interleave
    with the training's collectives.
    """
    what = os.fspath(checkpoint_id) if checkpoint_id is not None else \
        str(getattr(storage_writer, "path", "storage_writer"))
    if _world(process_group):
        guard.check_every_rank_calls(f"mp.checkpoint.async_save({what!r})", ctx)
    group = background_group(process_group, ctx)
    if storage_writer is not None:
        inner = run_dcp(torch_dcp.async_save, state_dict, storage_writer=storage_writer,
                        planner=planner, process_group=group)
        return _executor.submit(_finish_async, inner, what, None, group, after)
    if checkpoint_id is None:
        raise ValueError("async_save needs a checkpoint_id or a storage_writer")
    location, name = _split(checkpoint_id)
    tmp = temporary_name(name, process_group)
    inner = run_dcp(torch_dcp.async_save, state_dict,
                    storage_writer=writer_for(location.url(tmp)), planner=planner,
                    process_group=group, async_stager=_stager())
    _writing.append(inner)
    return _executor.submit(_finish_async, inner, location.url(name), (location, tmp, name),
                            group, after)


_staging = ReusedStaging()
_writing: list[concurrent.futures.Future] = []  # saves that may still read its copy


def _stager() -> ReusedStaging:
    """The stager of every ``async_save`` to a ``checkpoint_id``: it keeps its CPU copy
    of the state (:mod:`~modelparallel.checkpoint.staging`), so the next save copies
    into memory it already has. Before it copies, the saves still writing from that
    copy are waited for (it must not change under a save that writes it)."""
    concurrent.futures.wait(_writing)
    _writing.clear()
    return _staging


def background_group(process_group: dist.ProcessGroup | None,
                     ctx: ParallelContext | None) -> dist.ProcessGroup | None:
    """A gloo group of the same ranks as ``process_group`` (default: the world) for
    background checkpoint collectives, made once. Of a subgroup, only its members take
    part in making it (they may be the only ranks that save)."""
    if not dist.is_initialized():
        return process_group
    key = process_group or dist.group.WORLD
    if key not in _async_groups:
        ranks = dist.get_process_group_ranks(key)
        _async_groups[key] = dist.new_group(
            ranks, backend="gloo", timeout=_timeout(ctx),
            use_local_synchronization=len(ranks) < dist.get_world_size())
    return _async_groups[key]


def _timeout(ctx: ParallelContext | None) -> datetime.timedelta | None:
    """The background group's timeout: the configured one (torch's default before init)."""
    return ctx.collective_timeout if ctx is not None else None


def _finish_async(inner: concurrent.futures.Future, what: str,
                  commit: tuple[Location, str, str] | None, group,
                  after: Callable[[], None] | None) -> None:
    try:
        inner.result()
        if commit is not None:
            commit_directory(*commit, group)
    except (Exception, torch_dcp.CheckpointException) as e:
        if commit is not None:
            discard(*commit[:2])
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"async_save to {what} failed: {_first_failure(e)}") from e
    if after is not None:
        after()


def run_dcp(fn, state_dict: dict[str, Any], *, context: str = "", **kwargs: Any) -> Any:
    """Run a DCP function; its per-rank exception becomes one readable CheckpointError
    (``context`` says what was being done)."""
    try:
        return fn(state_dict, **kwargs)
    except torch_dcp.CheckpointException as e:
        raise CheckpointError(f"{context}{': ' if context else ''}{_first_failure(e)}") from e


def _first_failure(error: BaseException) -> str:
    failures = getattr(error, "failures", None)
    if not failures:
        return str(error)
    rank, failure = min(failures.items())
    exc = failure[0] if isinstance(failure, tuple) else failure
    return f"rank {rank}: {type(exc).__name__}: {exc}" + (
        f" (and {len(failures) - 1} other rank(s))" if len(failures) > 1 else "")
