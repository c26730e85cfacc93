"""Gradient clipping by the global norm of a model whose gradients are split over a mesh."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor


def clip_grad_norm_(model: nn.Module | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; returns that norm.

    The norm is over the whole model, whatever holds its pieces: gradients that are
    DTensors (tensor-parallel shards, FSDP2 shards, both) are reduced over their mesh,
    one collective per mesh; plain gradients (replicated) count once. An FSDP1 model
    uses its own ``clip_grad_norm_``. Same arguments as
    ``torch.nn.utils.clip_grad_norm_``; the returned norm is a plain tensor, equal on
    every rank.
    """
    if isinstance(model, FullyShardedDataParallel):
        return model.clip_grad_norm_(max_norm, norm_type)
    params = list(model.parameters() if isinstance(model, nn.Module) else model)
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(key, []).append(p)
    if not by_mesh:
        return torch.tensor(0.0)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type,
                                             error_if_nonfinite, foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = norms[0].device
    total = torch.nn.utils.get_total_norm([n.to(device) for n in norms], norm_type,
                                          error_if_nonfinite)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach)
    return total
