"""Checkpoints: sharded (DCP) and full, resharding across layouts, atomic commit,
rotation, safe loading, fsspec URLs.

The functions here take the :class:`~modelparallel.context.ParallelContext`; scripts
call them through ``mp.checkpoint`` (:mod:`modelparallel.smp.checkpoints`): SMP v1 style
``save_checkpoint`` / ``resume_from_checkpoint`` (also at ``mp.*``), SMP v2 / DCP style
``save``, ``load``, ``async_save``.
"""

from modelparallel.checkpoint.manager import info, newest
from modelparallel.checkpoint.storage import CheckpointError

__all__ = ["CheckpointError", "info", "newest"]
