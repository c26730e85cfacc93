"""What the SMP v2 saver and loader share: their process group and coordinator, the S3
arguments, and one-line notes for arguments that have no effect here."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from modelparallel.notices import notice
from modelparallel.smp.v2.checkpoint.s3_filesystem import is_s3_uri

_said: set[str] = set()


def say_once(key: str, message: str) -> None:
    """Say ``message`` once per run (rank 0's arguments; the others' are the same)."""
    if key not in _said:
        _said.add(key)
        notice("%s", message)


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device of tensors for a collective on ``group``: the current GPU for NCCL
    (and SMDDP's backend, NCCL where CUDA is), else the CPU."""
    backend = str(dist.get_backend(group))
    if torch.cuda.is_available() and backend in ("nccl", "smddp"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_coordinator(process_group: dist.ProcessGroup | None, coordinator_rank: int,
                      what: str) -> None:
    """Check SMP's ``coordinator_rank``: a *global* rank of ``process_group`` (SMP's
    examples pass ``min(ranks of the group)``).

    DCP coordinates from the group's first rank, so that is the rank to pass; the
    default 0 also means it when rank 0 is not in the group. Any other value is an
    error, raised before any collective.
    """
    if not dist.is_initialized():
        if coordinator_rank != 0:
            raise ValueError(f"{what}: coordinator_rank={coordinator_rank} without a process "
                             f"group: one process is its own coordinator (0)")
        return
    ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
    if coordinator_rank == ranks[0] or (coordinator_rank == 0 and 0 not in ranks):
        return
    if coordinator_rank not in ranks:
        raise ValueError(f"{what}: coordinator_rank={coordinator_rank} is not a rank of "
                         f"process_group (global ranks {_short(ranks)}); SMP's coordinator_rank "
                         f"is a global rank of the group, e.g. min(ranks) = {ranks[0]}")
    raise ValueError(f"{what}: coordinator_rank={coordinator_rank}: the checkpoint is "
                     f"coordinated from the group's first rank, {ranks[0]}; pass "
                     f"coordinator_rank={ranks[0]} (min of the group's ranks)")


def _short(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 8 else f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}]"


def s3_region_for(checkpoint_id: str | os.PathLike | None, s3_region: str | None,
                  s3client_config: Any, what: str) -> str | None:
    """The region to give fsspec/s3fs, or None. ``s3client_config`` configures
    s3torchconnector, which modelparallel does not use: refused."""
    if s3client_config is not None:
        raise ValueError(f"{what}: s3client_config configures SMP's s3torchconnector client; "
                         f"modelparallel reaches s3:// through fsspec (s3fs) and cannot apply "
                         f"it. Drop it, and configure s3fs (fsspec's config or the AWS "
                         f"environment variables) if you need to")
    if s3_region is None:
        return None
    if not is_s3_uri(checkpoint_id):
        say_once(f"{what}-s3_region", f"{what}: s3_region has no effect: the checkpoint "
                                      f"location is not an s3:// URI")
        return None
    return s3_region


def flat_keys(state_dict: Any, prefix: str = "") -> list[str]:
    """Every leaf of a nested state dict as a dotted key (DCP flattens it alike)."""
    keys: list[str] = []
    for key, value in state_dict.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            keys.extend(flat_keys(value, name + "."))
        else:
            keys.append(name)
    return keys
