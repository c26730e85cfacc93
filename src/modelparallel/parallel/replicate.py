"""Plain DistributedDataParallel over the data-parallel ranks, when nothing is sharded."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from modelparallel.state import state
from modelparallel.topology import CommGroup


def replicate(model: nn.Module, **ddp_kwargs) -> DistributedDataParallel:
    """Wrap ``model`` in DDP over the reduced data-parallel group (same stage, same TP shard).

    ``device_ids`` defaults to this rank's GPU on CUDA; other keyword arguments go to
    ``torch.nn.parallel.DistributedDataParallel`` unchanged.
    """
    s = state.require("mp.replicate()")
    if s.device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [s.device.index])
        model = model.to(s.device)
    ddp_kwargs.setdefault("process_group", s.process_group(CommGroup.RDP_GROUP))
    return DistributedDataParallel(model, **ddp_kwargs)
