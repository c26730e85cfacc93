"""Checkpoints: sharded (DCP) and full, resharding across layouts, atomic commit,
rotation, safe loading, fsspec URLs.

SMP v1 style: :func:`save_checkpoint` / :func:`resume_from_checkpoint` (also at
``mp.*``). SMP v2 / DCP style: :func:`save`, :func:`load`, :func:`async_save` take a
state dict as ``torch.distributed.checkpoint`` does.
"""

from modelparallel.checkpoint.dcp import async_save, load, save
from modelparallel.checkpoint.manager import (
    info,
    newest,
    resume_from_checkpoint,
    save_checkpoint,
)
from modelparallel.checkpoint.storage import CheckpointError

__all__ = ["CheckpointError", "async_save", "info", "load", "newest", "resume_from_checkpoint",
           "save", "save_checkpoint"]
