"""SMDDP-style data parallelism: port a script by changing its imports.

::

    import modelparallel.dataparallel as dist
    # was: import smdistributed.dataparallel.torch.distributed as dist
    from modelparallel.dataparallel import DistributedDataParallel as DDP
    # was: from smdistributed.dataparallel.torch.parallel.distributed import ...

The usual ``torch.distributed`` collectives are re-exported, so ``dist.all_reduce``,
``dist.barrier``, ``dist.broadcast`` ... keep working; ``dist.ReduceOp.AVERAGE`` (SMDDP
1.x) is a sum divided by the group's size.

SMDDP's current API maps here too: importing this module (``import
smdistributed.dataparallel.torch.torch_smddp``) registers the ``"smddp"`` backend, so
``torch.distributed.init_process_group(backend="smddp")`` works (NCCL on GPUs, gloo on
CPU; see :mod:`modelparallel.smp.smddp`), and a later ``mp.init()`` uses that group.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn
from torch.distributed import (  # noqa: F401 - re-exported for ported scripts
    all_gather,
    all_gather_object,
    all_to_all_single,
    barrier,
    broadcast,
    broadcast_object_list,
    get_rank,
    get_world_size,
    group,
    is_available,
    is_initialized,
    reduce,
)

from modelparallel.notices import notice
from modelparallel.smp.appliers import replicate
from modelparallel.smp.smddp import ReduceOp, all_reduce, register_backend  # noqa: F401
from modelparallel.smp.state import init, state

register_backend()  # torch_smddp's import side effect: backend="smddp" works


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


def DistributedDataParallel(module: nn.Module, device_ids: list[Any] | None = None,
                            output_device: Any = None, broadcast_buffers: bool = True,
                            process_group: Any = None, bucket_cap_mb: float | None = None,
                            **kwargs: Any) -> nn.parallel.DistributedDataParallel | nn.Module:
    """``torch.nn.parallel.DistributedDataParallel`` over the data-parallel ranks (a
    tensor-parallel model is replicated in place and returned as it is: ``mp.replicate``).

    SMDDP 1.x's arguments go to torch's DDP: ``process_group`` (default: the
    data-parallel group), ``bucket_cap_mb`` (default 25, as SMDDP's),
    ``broadcast_buffers`` (works here; SMDDP 1.x asked for False). ``device_ids`` and
    ``output_device`` are for GPU modules: on CPU they have no effect (one line says so).
    Other keyword arguments (``find_unused_parameters``, ...) go to DDP unchanged.
    """
    init_process_group()
    if state.device.type == "cpu" and (device_ids is not None or output_device is not None):
        notice("DistributedDataParallel: device_ids/output_device have no effect on "
               "CPU: the model trains on the CPU")
        device_ids = output_device = None
    if device_ids is not None:
        kwargs["device_ids"] = device_ids
    if output_device is not None:
        kwargs["output_device"] = output_device
    if process_group is not None:
        kwargs["process_group"] = process_group
    if bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    if not broadcast_buffers:
        kwargs["broadcast_buffers"] = False
    return replicate(module, **kwargs)
