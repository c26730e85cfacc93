"""FSDP1's optimizer state dicts of split experts (``wrappers.py``: FSDP2 units FSDP1
ignores), loaded as the experts hold them.

``FSDP.optim_state_dict`` leaves the state of parameters FSDP1 ignores as the optimizer
holds it: for an expert, a DTensor of the whole ``(experts, ...)`` state on the experts'
mesh, so a sharded checkpoint holds every expert at its global index. On the way back,
``FSDP.optim_state_dict_to_load`` leaves them as given, and what it is given is no
DTensor: torch's ``load_sharded_optimizer_state_dict`` reads every state as a
ShardedTensor chunked over a process group, and a ``FULL_STATE_DICT`` holds whole
tensors. :func:`states_to_load` makes each of them a DTensor laid out as its parameter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from modelparallel.parallel import expert_parallel

# the names torch's wrappers (FSDP1, activation checkpointing and offloading) put in a
# parameter's name and take out of state dict keys
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.",
                     "_offload_wrapped_module.")


def expert_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """State-dict name -> parameter, for the split experts' parameters of ``model`` (an
    FSDP1 root or a module around it)."""
    held = {id(p) for p in expert_parallel.expert_parameters(model)}
    found: dict[str, nn.Parameter] = {}
    for name, p in model.named_parameters():
        if id(p) in held:
            for prefix in _WRAPPER_PREFIXES:
                name = name.replace(prefix, "")
            found[name] = p
    return found


def states_to_load(model: nn.Module, per_param: dict[Any, Any]) -> dict[Any, Any]:
    """``per_param`` (an optimizer state dict's ``"state"``, by name) with each expert's
    states made DTensors laid out as the expert's parameter (collective: every rank
    converts the same states in the same order)."""
    experts = expert_params(model)
    out = dict(per_param)
    for fqn in sorted(set(experts) & set(out)):
        out[fqn] = {name: _like(value, experts[fqn])
                    for name, value in sorted(out[fqn].items())}
    return out


def _like(value: Any, param: nn.Parameter) -> Any:
    """``value`` (whole, a DTensor of another layout, or a ShardedTensor) as a DTensor laid
    out as ``param``; a scalar (a step count) or a value of another shape as it is."""
    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or \
            value.dim() == 0:
        return value
    if isinstance(value, DTensor):
        if value.device_mesh == param.device_mesh and value.placements == param.placements:
            return value
        value = value.full_tensor()
    elif callable(getattr(value, "local_shards", None)):  # a ShardedTensor
        value = _whole(value, param.device)
    if value.shape != param.shape:
        return value
    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                             src_data_rank=None)  # this rank's part, no traffic


def _whole(value: Any, device: torch.device) -> torch.Tensor:
    """The whole tensor of a ShardedTensor: each rank's chunks in place, summed over its
    process group (each element is held by one rank of it)."""
    shards = value.local_shards()
    whole = torch.zeros(value.size(), dtype=value.dtype, device=device)
    for shard in shards:
        where = tuple(slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets,
                                                      shard.metadata.shard_sizes, strict=True))
        whole[where] = shard.tensor.to(device)
    # private, and the only way to the group a ShardedTensor is chunked over
    dist.all_reduce(whole, group=value._process_group)
    return whole
