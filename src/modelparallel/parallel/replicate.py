"""Replicated data parallelism (DDP) over the data-parallel ranks, when nothing is sharded."""

from __future__ import annotations

from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate as replicate_dtensors
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from modelparallel.parallel.blocks import find_blocks
from modelparallel.state import state
from modelparallel.topology import CommGroup


def replicate(model: nn.Module, **ddp_kwargs) -> nn.Module:
    """Replicate ``model`` over the reduced data-parallel group (same stage, same TP shard);
    gradients are averaged over it after every backward.

    A plain model is wrapped in ``torch.nn.parallel.DistributedDataParallel``
    (``device_ids`` defaults to this rank's GPU on CUDA; other keyword arguments go to
    DDP unchanged). A tensor-parallel model (DTensor parameters) is replicated in place
    by PyTorch's DTensor-aware DDP (``replicate`` built on FSDP2's machinery, one
    gradient bucket per block) and returned as it is: classic DDP does not understand
    DTensor parameters.
    """
    s = state.require("mp.replicate()")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        if ddp_kwargs:
            raise TypeError(f"mp.replicate() of a tensor-parallel model takes no DDP arguments "
                            f"(got {sorted(ddp_kwargs)})")
        mesh = s.meshes["rdp"]
        for block in find_blocks(model):
            replicate_dtensors(block, mesh=mesh)
        replicate_dtensors(model, mesh=mesh)
        return model
    if s.device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [s.device.index])
        model = model.to(s.device)
    ddp_kwargs.setdefault("process_group", s.process_group(CommGroup.RDP_GROUP))
    return DistributedDataParallel(model, **ddp_kwargs)
