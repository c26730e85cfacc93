"""SMDDP-style data parallelism: port a script by changing its imports.

::

    import modelparallel.dataparallel as dist
    # was: import smdistributed.dataparallel.torch.distributed as dist
    from modelparallel.dataparallel import DistributedDataParallel as DDP
    # was: from smdistributed.dataparallel.torch.parallel.distributed import ...

The usual ``torch.distributed`` collectives are re-exported, so ``dist.all_reduce``,
``dist.barrier``, ``dist.broadcast`` ... keep working.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn
from torch.distributed import (  # noqa: F401 - re-exported for ported scripts
    ReduceOp,
    all_gather,
    all_gather_object,
    all_reduce,
    barrier,
    broadcast,
    broadcast_object_list,
    get_rank,
    get_world_size,
    is_initialized,
    reduce,
)

from modelparallel.smp.appliers import replicate
from modelparallel.smp.state import init, state


def init_process_group(backend: str | None = None, **kwargs) -> None:
    """Initialize modelparallel for data parallelism (``backend="smddp"`` means auto).

    Idempotent; the configuration comes from the launcher's ``MP_CONFIG`` if any.
    """
    if state.initialized:
        return
    config = {}
    if backend not in (None, "smddp", "auto"):
        config["ddp_dist_backend"] = backend
    init(config, **kwargs)


def get_local_rank() -> int:
    """Rank of this process on its host."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_local_size() -> int:
    """Number of processes on this host."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def DistributedDataParallel(module: nn.Module, **kwargs: Any) -> nn.Module:
    """``torch.nn.parallel.DistributedDataParallel`` over the data-parallel ranks (a
    tensor-parallel model is replicated in place and returned as it is: ``mp.replicate``)."""
    init_process_group()
    return replicate(module, **kwargs)
