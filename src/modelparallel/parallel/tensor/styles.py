"""Parallel styles DTensor does not ship: GPT-2's ``Conv1D`` and fused projections.

``Conv1D`` is a linear layer with its weight stored transposed, ``(in, out)``; DTensor's
``ColwiseParallel``/``RowwiseParallel`` accept only ``nn.Linear``/``nn.Embedding``, so
these subclasses differ only in which weight dimension they shard. The forward is the
module's own, run on DTensors.

A fused projection (GPT-2's ``c_attn`` computes ``[q | k | v]`` in one matmul) cannot be
split contiguously: rank 0 would get all of q and half of k. ``FusedColwiseConv1D``
stores the weight as ``(in, chunks, out / chunks)`` sharded on the last dimension, so
each rank holds its heads of every chunk and computes ``[q_r | k_r | v_r]`` locally.
State dicts keep the original ``(in, out)`` shape and name; ``stored_shapes`` tells
loaders how a full tensor maps onto the stored parameter.
"""

from __future__ import annotations

import types
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor import distribute_tensor as _distribute
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from modelparallel.module_state import lookup, state_of


def _distribute_params(module: nn.Module, mesh: DeviceMesh, placements: dict,
                       src_data_rank: int | None) -> None:
    for name, placement in placements.items():
        param = getattr(module, name, None)
        if param is None:
            continue
        split = _distribute(param, mesh, [placement], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))


def _apply_conv1d(style: ColwiseParallel | RowwiseParallel, module: nn.Module,
                  device_mesh: DeviceMesh, placements: dict) -> nn.Module:
    """``style._apply`` with ``Conv1D`` parameters distributed to ``placements``."""

    def partition(name, mod, mesh):
        _distribute_params(mod, mesh, placements, style.src_data_rank)

    return distribute_module(
        module, device_mesh, partition,
        partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
        partial(style._prepare_output_fn, style.output_layouts, style.use_local_output))


class ColwiseConv1D(ColwiseParallel):
    """Column-parallel ``Conv1D``: weight ``(in, out)`` sharded on ``out``, bias too."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return _apply_conv1d(self, module, device_mesh, {"weight": Shard(1), "bias": Shard(0)})


class RowwiseConv1D(RowwiseParallel):
    """Row-parallel ``Conv1D``: weight ``(in, out)`` sharded on ``in``, bias replicated."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return _apply_conv1d(self, module, device_mesh,
                             {"weight": Shard(0), "bias": Replicate()})


class FusedColwiseConv1D(ColwiseParallel):
    """Column-parallel fused ``Conv1D`` of ``chunks`` equal outputs (``[q | k | v]``).

    The input must be replicated over the tensor-parallel ranks; the output is this
    rank's ``[q_r | k_r | v_r]`` as a plain tensor.
    """

    def __init__(self, chunks: int):
        super().__init__()
        self.chunks = chunks

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layer: Any = module  # transformers' Conv1D: weight (nx, nf), bias (nf)
        chunks, nx, nf = self.chunks, layer.weight.shape[0], layer.weight.shape[1]
        if nf % chunks:
            raise ValueError(f"fused width {nf} does not split into {chunks} chunks")
        width = nf // chunks
        weight = layer.weight.detach().view(nx, chunks, width)
        bias = layer.bias.detach().view(chunks, width)
        src = self.src_data_rank
        module.register_parameter("weight", nn.Parameter(
            _distribute(weight, device_mesh, [Shard(2)], src_data_rank=src)))
        module.register_parameter("bias", nn.Parameter(
            _distribute(bias, device_mesh, [Shard(1)], src_data_rank=src)))
        layer.forward = types.MethodType(_fused_forward, module)
        state_of(layer).stored_shapes = {"weight": (nx, chunks, width), "bias": (chunks, width)}
        module.register_state_dict_post_hook(partial(_fused_state_dict, nf=nf))
        module.register_load_state_dict_pre_hook(_fused_load_state_dict)
        return module


def _fused_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    weight, bias = self.weight, self.bias  # DTensors on the TP mesh (gathered by FSDP if any)
    mesh = weight.device_mesh
    # Identity forward, all-reduce of the input gradient backward (Megatron's "f").
    x = DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(
        grad_placements=[Partial()])
    w, b = weight.to_local(), bias.to_local()
    out = torch.addmm(b.reshape(-1), x.reshape(-1, x.shape[-1]), w.reshape(w.shape[0], -1))
    return out.view(*x.shape[:-1], -1)


def unfuse(value: torch.Tensor, dims: int, nf: int) -> torch.Tensor:
    """``(..., chunks, width)`` back to ``(..., nf)``: gather the shards of the two merged
    dims (TP's, and FSDP's when it shards a bias on the chunk dim), then merge."""
    if isinstance(value, DTensor):
        placements = [Replicate() if isinstance(p, Shard) and p.dim >= dims - 2 else p
                      for p in value.placements]
        value = value.redistribute(placements=placements)
    return value.reshape(*value.shape[:dims - 2], nf)


def _fused_state_dict(module, state_dict, prefix, local_metadata, *, nf: int) -> None:
    for name, dims in (("weight", 3), ("bias", 2)):
        key = prefix + name
        if key in state_dict:
            state_dict[key] = unfuse(state_dict[key], dims, nf)


def _fused_load_state_dict(module, state_dict, prefix, *args) -> None:
    for name in ("weight", "bias"):
        key, param = prefix + name, getattr(module, name)
        if key not in state_dict:
            continue
        value = state_dict[key]
        shaped = value.reshape(param.shape)  # (..., nf) -> (..., chunks, width)
        if isinstance(shaped, DTensor):
            state_dict[key] = shaped.redistribute(param.device_mesh, param.placements)
        else:  # a full tensor, the same on every rank: take this rank's slice
            state_dict[key] = _distribute(shaped, param.device_mesh, param.placements,
                                          src_data_rank=None)


# what FSDP1 and torch's checkpoint wrapper insert in module paths
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def stored_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Parameter name -> stored shape, for parameters stored in another shape than their
    state-dict entry (fused projections)."""
    out = {}
    for path, module in model.named_modules():
        for name, shape in lookup(module, "stored_shapes", {}).items():
            fqn = f"{path}.{name}" if path else name
            for wrapper in _WRAPPER_PREFIXES:  # state dicts name parameters without them
                fqn = fqn.replace(wrapper, "")
            out[fqn] = shape
    return out
