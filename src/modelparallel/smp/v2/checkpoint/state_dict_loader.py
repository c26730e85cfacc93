"""``torch.sagemaker.distributed.checkpoint.state_dict_loader``: SMP v2's ``load`` on
``torch.distributed.checkpoint`` (DCP): in place, resharding to the layout of the state
dict's tensors, with SMP's check that every rank asks for the same keys.

Loading is safe: the metadata is read with an unpickler that accepts only DCP's types,
and non-tensor entries with ``torch.load(weights_only=True)`` (also when the script passes
DCP's plain ``DefaultLoadPlanner``, which would unpickle anything).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, LoadPlanner, StorageReader

from modelparallel.checkpoint import dcp
from modelparallel.checkpoint.storage import CheckpointError, SafeLoadPlanner, reader_for
from modelparallel.smp.state import state
from modelparallel.smp.v2.checkpoint._common import check_coordinator, flat_keys, s3_region_for
from modelparallel.smp.v2.checkpoint.filesystem import DistributedFileSystemReader


class CheckpointKeyError(CheckpointError, KeyError):
    """The checkpoint lacks a key the state dict asks for (a ``CheckpointError``, and a
    ``KeyError`` as scripts written for SMP catch)."""

    __str__ = BaseException.__str__  # KeyError would quote the message


def load(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
         storage_reader: StorageReader | None = None, planner: LoadPlanner | None = None,
         process_group: dist.ProcessGroup | None = None, check_keys_matched: bool = True,
         coordinator_rank: int = 0, s3_region: str | None = None,
         s3client_config: Any = None) -> None:
    """Load a checkpoint into ``state_dict`` in place (collective over ``process_group``,
    default the world; ``coordinator_rank`` is the group's first global rank).

    ``check_keys_matched``: first check that every rank of the group asks for the same
    keys; if not, every rank raises a ``CheckpointError`` naming the ranks and keys that
    differ. A key the checkpoint lacks raises :class:`CheckpointKeyError`.
    """
    if checkpoint_id is None and storage_reader is None:
        raise ValueError("load: pass checkpoint_id or storage_reader")
    check_coordinator(process_group, coordinator_rank, "load")
    where = checkpoint_id if checkpoint_id is not None else getattr(storage_reader, "path", None)
    region = s3_region_for(where, s3_region, s3client_config, "load")
    if storage_reader is None:
        assert checkpoint_id is not None
        storage_reader = DistributedFileSystemReader(checkpoint_id, s3_region=region) \
            if region else reader_for(checkpoint_id)
    elif checkpoint_id is not None:
        storage_reader.reset(checkpoint_id)  # DCP's meaning: read from there
    if check_keys_matched and dist.is_initialized():
        check_same_keys(state_dict, process_group)
    try:
        dcp.load(state_dict, checkpoint_id=os.fspath(where or type(storage_reader).__name__),
                 ctx=state.context_or_none(), storage_reader=storage_reader,
                 planner=safe_planner(planner), process_group=process_group)
    except CheckpointError as e:
        if "Missing key in checkpoint state_dict" in str(e):
            raise CheckpointKeyError(str(e)) from e
        raise


def safe_planner(planner: LoadPlanner | None) -> LoadPlanner:
    """The planner to load with: DCP's plain ``DefaultLoadPlanner`` (or none) becomes
    the same planner loading non-tensor entries with ``weights_only=True``."""
    if planner is None:
        return SafeLoadPlanner()
    if type(planner) is DefaultLoadPlanner:
        return SafeLoadPlanner(flatten_state_dict=planner.flatten_state_dict,
                               flatten_sharded_tensors=planner.flatten_sharded_tensors,
                               allow_partial_load=planner.allow_partial_load)
    return planner


def check_same_keys(state_dict: dict[str, Any], process_group: dist.ProcessGroup | None) -> None:
    """Raise a CheckpointError on every rank of the group unless all ask for the same
    (flattened) keys."""
    keys = sorted(flat_keys(state_dict))
    digest = hashlib.sha256("\n".join(keys).encode()).hexdigest()
    size = dist.get_world_size(process_group)
    digests: list[Any] = [None] * size
    dist.all_gather_object(digests, digest, group=process_group)
    if len(set(digests)) == 1:
        return
    every: list[Any] = [None] * size
    dist.all_gather_object(every, keys, group=process_group)
    ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
    first = set(every[0])
    lines = []
    for index, theirs in enumerate(every[1:], start=1):
        if set(theirs) == first:
            continue
        missing, extra = sorted(first - set(theirs)), sorted(set(theirs) - first)
        lines.append(f"rank {ranks[index]} lacks {_few(missing)} and has {_few(extra)} "
                     f"more than rank {ranks[0]}")
    raise CheckpointError("load: the ranks ask for different keys (check_keys_matched=True): "
                          + "; ".join(lines[:4]) + ". Every rank must pass a state dict with "
                          "the same keys (or pass check_keys_matched=False)")


def _few(keys: list[str]) -> str:
    if not keys:
        return "no keys"
    shown = ", ".join(repr(k) for k in keys[:3])
    return f"{len(keys)} key(s) ({shown}{', ...' if len(keys) > 3 else ''})"


__all__ = ["CheckpointKeyError", "load"]
