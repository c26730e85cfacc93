"""Moving a model whose parts may live on another rank (meta tensors) to this device."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from modelparallel.module_state import lookup
from modelparallel.parallel.pipeline.absent import AbsentTensor


def is_meta(t: torch.Tensor) -> bool:
    """A placeholder for a tensor another rank holds: meta (possibly inside a DTensor),
    or the stand-in a pipeline keeps for another stage's tensor (real dtype and device,
    no values: ``pipeline.absent``)."""
    return isinstance(t, AbsentTensor) or \
        (t.to_local() if isinstance(t, DTensor) else t).device.type == "meta"


def on_mesh_dims(t: torch.Tensor, dims: set[str]) -> bool:
    """Whether ``t`` is a DTensor laid over any of the mesh dims ``dims``."""
    return isinstance(t, DTensor) and bool(set(t.device_mesh.mesh_dim_names or ()) & dims)


def holds_tensor_parallel(module: nn.Module) -> bool:
    """Whether ``module`` has parameters tensor parallelism split (DTensors on ``tp``)."""
    return any(on_mesh_dims(p, {"tp"}) for p in module.parameters())


def tp_ranks_are_replicas(model: nn.Module, tp: int) -> bool:
    """Whether the ``tp`` tensor-parallel ranks hold ``model`` whole (nothing of it is
    split), so that each trains it on its own batch and they act as data-parallel
    replicas: its gradients are averaged over them too (SMP v1's rule for modules
    tensor parallelism does not split). A model with any split layer runs its tensor-
    parallel group's batches together instead (see ``batch.py``)."""
    if tp == 1:
        return False
    split = lookup(model, "tensor_parallel_split")
    if split is None:  # transform() never saw it: split if it holds tensor-parallel shards
        split = holds_tensor_parallel(model)
    return not split


def to_device(module: nn.Module, device: torch.device) -> None:
    """Move ``module``'s real tensors to ``device`` in place (``Module.to`` fails on meta
    tensors); Parameter objects stay the same, so optimizers and ties keep them."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if not is_meta(t) and not isinstance(t, DTensor) and t.device != device:
                t.data = t.data.to(device)


def materialize_meta(module: nn.Module, device: torch.device) -> None:
    """Give every meta parameter and buffer of ``module`` uninitialized storage on
    ``device``. A parameter several modules share (tied weights) stays one Parameter."""
    made: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None and is_meta(p) and not isinstance(p, DTensor):
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty_like(p, device=device),
                                               requires_grad=p.requires_grad)
                sub._parameters[name] = made[id(p)]
        for name, b in list(sub._buffers.items()):
            if b is not None and is_meta(b):
                sub._buffers[name] = torch.empty_like(b, device=device)
