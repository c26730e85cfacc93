"""Gradient clipping by the global norm of a model whose gradients are split over a mesh."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from modelparallel.parallel import expert_parallel, fsdp1_torch


def clip_grad_norm_(model: nn.Module | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; returns that norm.

    The norm is over the whole model, whatever holds its pieces: gradients that are
    DTensors (tensor-parallel shards, FSDP2 shards, both) are reduced over their mesh,
    one collective per mesh; plain gradients (replicated) count once; a pipeline-split
    ``DistributedModel`` adds up its stages (a parameter several stages hold counts
    once). An FSDP1 model uses its own ``clip_grad_norm_`` (:func:`fsdp1_clip_grad_norm_`
    when it holds tensor-parallel parameters or split experts); a module that holds FSDP1
    units inside (torch's ``offload_wrapper`` or ``checkpoint_wrapper`` around the FSDP1 root, as
    SMP v2's scripts have it) uses :func:`fsdp1_clip_grad_norm_`. Same arguments as
    ``torch.nn.utils.clip_grad_norm_``; the returned norm is a plain tensor, equal on
    every rank.
    """
    if isinstance(model, FullyShardedDataParallel):
        if fsdp1_torch.holds_split_params(model) or \
                expert_parallel.split_experts(model.module):
            return fsdp1_clip_grad_norm_(model, max_norm, norm_type, error_if_nonfinite,
                                         foreach)
        return model.clip_grad_norm_(max_norm, norm_type)
    if isinstance(model, nn.Module) and any(
            isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return fsdp1_clip_grad_norm_(model, max_norm, norm_type, error_if_nonfinite, foreach)
    stages = None
    if hasattr(model, "grad_norm_parts"):  # a DistributedModel: counted part, stage group
        counted, params, stages = model.grad_norm_parts()  # type: ignore[operator]
    else:
        params = list(model.parameters() if isinstance(model, nn.Module) else model)
        counted = params
    by_mesh = _by_mesh(params)
    norms = [_norm([p.grad for p in group], norm_type, error_if_nonfinite, foreach)
             for group in _by_mesh(counted).values()]
    device = next((g.device for group in by_mesh.values() for g in group),
                  torch.device("cpu"))
    total = torch.nn.utils.get_total_norm([n.to(device) for n in norms], norm_type,
                                          error_if_nonfinite) if norms else \
        torch.zeros((), device=device)
    if stages is not None:  # add up the pipeline stages' parts
        p = float(norm_type)
        part = _powered(_summable(total), p)
        dist.all_reduce(part, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM,
                        group=stages)
        total = part if math.isinf(p) else part ** (1.0 / p)
    if by_mesh:
        _scale(by_mesh, max_norm, total, foreach)
    return total


def fsdp1_clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                          error_if_nonfinite: bool = False,
                          foreach: bool | None = None) -> torch.Tensor:
    """``clip_grad_norm_`` of a module holding FSDP1 units (tensor-parallel or not).

    FSDP1's own sums its gradient shards over its shard group only, so each
    tensor-parallel rank counted just its own slice of every split parameter. Here each
    shard of a split parameter is summed over its tensor-parallel ranks too, replicated
    ones (plain, or DTensors replicated over ``tp``) once, and what FSDP does not shard
    once per rank. Works for ``use_orig_params`` True and False, on the FSDP1 root or a
    module around it.
    """
    p = float(norm_type)
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    pieces, unmanaged = fsdp1_torch.grad_pieces(model)
    # one bucket per (tensor-parallel groups, shard group), the same on every rank
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for piece in pieces:
        grads = buckets.setdefault((piece.split, piece.sharded), [])
        if piece.grad is not None:
            grads.append(piece.grad)
    device = next((g.device for gs in buckets.values() for g in gs), torch.device("cpu"))
    total = torch.zeros((), device=device)
    for (split, sharded), grads in buckets.items():
        part = _powered(_summable(_norm(grads, p, False, foreach)).to(device), p)
        for group in (*split, sharded):
            if group is not None:
                dist.all_reduce(part, op=op, group=group)
        total = torch.maximum(total, part) if math.isinf(p) else total + part
    for group in _by_mesh(unmanaged).values():
        part = _powered(_summable(_norm([q.grad for q in group], p, False, foreach)).to(device),
                        p)
        total = torch.maximum(total, part) if math.isinf(p) else total + part
    total = total if math.isinf(p) else total ** (1.0 / p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {p} for gradients from `parameters` is "
                           "non-finite, so it cannot be clipped. To disable this error and "
                           "scale the gradients by the non-finite norm anyway, set "
                           "`error_if_nonfinite=False`")
    _scale(_by_mesh(list(model.parameters())), max_norm, total, foreach)
    return total


def mixes_meshes(params: Sequence[torch.Tensor]) -> bool:
    """Whether the gradients of ``params`` are DTensors on several meshes, or DTensors and
    plain tensors: what torch's ``clip_grad_norm_`` cannot add up."""
    return len(_by_mesh(params)) > 1


def _by_mesh(params: Sequence[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    """Parameters with gradients, by the mesh of their gradient (None: plain tensors)."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(key, []).append(p)
    return by_mesh


def _norm(grads: Sequence[torch.Tensor | None], norm_type: float, error_if_nonfinite: bool,
          foreach: bool | None) -> torch.Tensor:
    """The norm of ``grads`` as a plain tensor (a DTensor's over its whole mesh)."""
    norm = torch.nn.utils.get_total_norm([g for g in grads if g is not None], norm_type,
                                         error_if_nonfinite, foreach)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _summable(norm: torch.Tensor) -> torch.Tensor:
    """``norm`` in float32 at least, to be summed over ranks: half-precision norms gain
    range, float64 ones keep their precision (``.float()`` cut them to float32)."""
    return norm.to(torch.promote_types(norm.dtype, torch.float32))


def _powered(norm: torch.Tensor, p: float) -> torch.Tensor:
    return norm if math.isinf(p) else norm ** p


def _scale(by_mesh: dict[object, list[torch.Tensor]], max_norm: float, total: torch.Tensor,
           foreach: bool | None) -> None:
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach)
