"""FSDP1's state dicts of a tensor-parallel model (or one whose experts expert
parallelism split: ``expert_parallel/fsdp1_states.py``), keyed and shaped as for one
process.

- ``FULL_STATE_DICT`` (model and ``FSDP.optim_state_dict``) holds whole tensors, not
  tensor-parallel parts; ``FSDP.optim_state_dict_to_load`` takes them back
  (:func:`install` routes FSDP1's two optimizer-state functions through here);
- :func:`global_state_dict` / :func:`local_state_dict` turn FSDP1's SHARDED_STATE_DICT
  into DTensors of whole parameters and back, for ``mp.save_checkpoint``.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType
from torch.distributed.tensor import DTensor, distribute_tensor

from modelparallel.module_state import lookup
from modelparallel.parallel import fsdp1_torch
from modelparallel.parallel.expert_parallel.fsdp1_states import expert_params, states_to_load


def full_tensors(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                  local_metadata: Any) -> None:
    """FULL_STATE_DICT: whole tensors, not tensor-parallel DTensors (every rank of a
    tensor-parallel group that returns a state dict gathers together)."""
    settings = FullyShardedDataParallel.get_state_dict_type(module)
    if settings.state_dict_type is not StateDictType.FULL_STATE_DICT:
        return
    for key, value in state_dict.items():
        if key.startswith(prefix) and isinstance(value, DTensor):
            # offloaded to the CPU by FSDP: gather on the mesh's device
            moved: Any = value.to(value.device_mesh.device_type)  # still a DTensor
            full = moved.full_tensor()
            state_dict[key] = full.cpu() if settings.state_dict_config.offload_to_cpu else full


# -- FSDP.optim_state_dict under FULL_STATE_DICT: whole tensors -----------------------------

_original_optim_state_dict = FullyShardedDataParallel.optim_state_dict
_original_optim_state_dict_to_load = FullyShardedDataParallel.optim_state_dict_to_load


def _full_type(model: nn.Module, split: dict) -> Any:
    """FSDP1's state dict settings of ``model`` when it holds split parameters and is
    set to FULL_STATE_DICT, else None."""
    if not split:
        return None
    settings = FullyShardedDataParallel.get_state_dict_type(model)
    return settings if settings.state_dict_type is StateDictType.FULL_STATE_DICT else None


@functools.wraps(_original_optim_state_dict)
def _optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                      optim_state_dict: dict[str, Any] | None = None,
                      group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """FULL_STATE_DICT: the state of tensor-parallel parameters whole, as for one process.

    FSDP1 gathers each state over its data-parallel ranks only, into a DTensor over the
    tensor-parallel ranks, and with ``rank0_only`` only on rank 0 of ``group`` (whose
    tensor-parallel peers then had nothing to gather with). Here every rank gathers the
    whole tensors together, then ``rank0_only`` keeps them on rank 0 of ``group``."""
    split = fsdp1_torch.split_params(model)
    settings = _full_type(model, split or expert_params(model))
    if settings is None:
        return _original_optim_state_dict(model, optim, optim_state_dict,
                                          _key_group(split, group))
    config = settings.optim_state_dict_config
    everywhere = dataclasses.replace(config, rank0_only=False, offload_to_cpu=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # FSDP.state_dict_type
        with FullyShardedDataParallel.state_dict_type(model, settings.state_dict_type,
                                                      settings.state_dict_config, everywhere):
            osd = _original_optim_state_dict(model, optim, optim_state_dict,
                                             _key_group(split, group))
    per_param = osd.get("state", {})
    for fqn in sorted(per_param, key=str):  # the same order on every rank
        for name, value in sorted(per_param[fqn].items()):
            if isinstance(value, DTensor):
                value = value.full_tensor()
            elif fqn in split and isinstance(value, torch.Tensor) and value.dim() and \
                    value.shape != split[fqn].shape:
                raise RuntimeError(f"FSDP1 gave the optimizer state {name!r} of the "
                                   f"tensor-parallel parameter {fqn} as a part, shaped "
                                   f"{list(value.shape)} (whole: {list(split[fqn].shape)})")
            if isinstance(value, torch.Tensor) and config.offload_to_cpu:
                value = value.cpu()
            per_param[fqn][name] = value
    if getattr(config, "rank0_only", False) and dist.get_rank(group) != 0:
        return {}
    return osd


@functools.wraps(_original_optim_state_dict_to_load)
def _optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer,
                              optim_state_dict: dict[str, Any], is_named_optimizer: bool = False,
                              load_directly: bool = False,
                              group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """FULL_STATE_DICT: whole states of tensor-parallel parameters (what
    :func:`_optim_state_dict` gives) become this rank's part before FSDP1 flattens them
    (FSDP1 would cut its shard out of the whole tensor as if it were this rank's part)."""
    split = fsdp1_torch.split_params(model)
    experts = expert_params(model)
    settings = _full_type(model, split or experts)
    if settings is not None and optim_state_dict and "state" in optim_state_dict:
        if getattr(settings.optim_state_dict_config, "rank0_only", False):
            raise ValueError("an FSDP1 model with tensor-parallel parameters or split "
                             "experts cannot load a full optimizer state with "
                             "rank0_only=True (rank 0's part would reach every rank); load "
                             "it on every rank with rank0_only=False")
        per_param = dict(optim_state_dict["state"])
        for fqn in sorted(per_param, key=str):
            param = split.get(fqn) if isinstance(fqn, str) else None
            if param is not None:
                per_param[fqn] = {name: _part(value, param)
                                  for name, value in sorted(per_param[fqn].items())}
        optim_state_dict = {**optim_state_dict, "state": per_param}
    if experts and optim_state_dict and "state" in optim_state_dict:  # FSDP1 ignores them
        optim_state_dict = {**optim_state_dict, "state": states_to_load(
            model, optim_state_dict["state"])}
    return _original_optim_state_dict_to_load(model, optim, optim_state_dict,
                                              is_named_optimizer, load_directly,
                                              _key_group(split, group))


def _key_group(split: dict, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group FSDP1 agrees on optimizer state keys over. For flat parameters it
    broadcasts them with ``src=0``, a global rank: a shard group without global rank 0
    (every shard group of tensor-parallel rank > 0, which DCP passes) fails with "Global
    rank 0 is not part of group". Every rank holds the same names, so the default group
    agrees on the same keys (every rank switches alike: the groups are the same size)."""
    if split and group is not None and group.size() != dist.get_world_size():
        return None
    return group


def _part(value: Any, param: fsdp1_torch.SplitParam) -> Any:
    """A whole tensor (or DTensor) -> this rank's tensor-parallel part; others as they are."""
    if isinstance(value, DTensor):
        if value.shape != param.shape:
            return value
        if value.device_mesh == param.mesh and tuple(value.placements) == param.placements:
            return value.to_local()
        value = value.full_tensor()
    if not isinstance(value, torch.Tensor) or value.shape != param.shape:
        return value
    mesh = param.mesh
    return distribute_tensor(value.to(mesh.device_type), mesh, param.placements,
                             src_data_rank=None).to_local().to(value.device)


# -- sharded state dicts by global name (mp.save_checkpoint) --------------------------------

class UnsupportedCheckpoint(ValueError):
    """The model's sharded state cannot be expressed by global parameter name."""


def checkpoint_problem(model: nn.Module) -> str | None:
    """Why :func:`global_state_dict` cannot name ``model``'s sharded state by global
    parameter name, or None. The same on every rank (it reads only the model)."""
    for unit in FullyShardedDataParallel.fsdp_modules(model):
        if not fsdp1_torch.holds_split_params(unit):
            continue
        if not lookup(unit, "fsdp1_policy", False):
            return ("this FSDP1 model holds tensor-parallel parameters, but was built with "
                    "the script's own process_group/device_mesh, so its sharded state "
                    "holds each tensor-parallel rank's part under the parameter's name; "
                    "build FSDP1 without process_group/device_mesh after mp.init() (or "
                    "shard with mp.shard)")
        if unit._device_mesh is None:
            return ("this FSDP1 model holds tensor-parallel parameters but has no device "
                    "mesh; build FSDP1 without process_group after mp.init()")
    return None


def load_problem(model: nn.Module) -> str | None:
    """Why state cannot be loaded into ``model``'s sharded FSDP1 units, or None. The same
    on every rank (it reads only the model)."""
    from modelparallel.parallel.tensor.styles import stored_shapes

    fused = sorted(set(stored_shapes(model)) & set(fsdp1_torch.split_params(model)))
    if fused:
        return (f"FSDP1 cannot load the fused projections tensor parallelism stores as "
                f"(..., chunks, width) ({', '.join(fused[:3])}{' ...' if len(fused) > 3 else ''}"
                f"): their load hook receives FSDP1's whole tensor for its tensor-parallel "
                f"part; resume this checkpoint with mp.shard (FSDP2) instead of FSDP1, or "
                f"without tensor_parallel_degree")
    return None


def global_state_dict(model: nn.Module, sd: dict[str, Any], *,
                      optimizer: bool = False) -> dict[str, Any]:
    """``sd`` (a SHARDED_STATE_DICT of ``model``, flattened optimizer state when
    ``optimizer``) with each tensor-parallel parameter's entries as a DTensor of the whole
    parameter over (tensor-parallel x FSDP1's data-parallel) ranks: keyed and shaped as
    for one process, so DCP saves them once and reshards them to any layout. Shares the
    entries' memory; no communication."""
    split = fsdp1_torch.split_params(model)
    if not split:
        return sd
    out = dict(sd)
    for key, value in sd.items():
        param = split.get(_param_name(key, optimizer))
        if param is None or not isinstance(value, DTensor) or param.data_mesh is None \
                or value.shape != param.local_shape or value.device_mesh != param.data_mesh:
            continue
        mesh = _joint_mesh(_root_mesh(model), param.mesh, param.data_mesh)
        out[key] = DTensor.from_local(value.to_local(), mesh,
                                      (*param.placements, *value.placements), run_check=False,
                                      shape=param.shape, stride=param.stride)
    return out


def local_state_dict(model: nn.Module, sd: dict[str, Any], *,
                     optimizer: bool = False) -> dict[str, Any]:
    """The inverse of :func:`global_state_dict`: what FSDP1's SHARDED_STATE_DICT loads."""
    split = fsdp1_torch.split_params(model)
    if not split:
        return sd
    out = dict(sd)
    for key, value in sd.items():
        param = split.get(_param_name(key, optimizer))
        if param is None or not isinstance(value, DTensor) or param.data_mesh is None \
                or value.shape != param.shape or value.shape == param.local_shape:
            continue
        n = len(param.placements)
        if value.device_mesh != _joint_mesh(_root_mesh(model), param.mesh, param.data_mesh):
            raise UnsupportedCheckpoint(f"{key}: a DTensor on mesh {value.device_mesh}, not "
                                        f"one of global_state_dict")
        local = value.to_local()
        out[key] = DTensor.from_local(local, param.data_mesh, value.placements[n:],
                                      run_check=False, shape=param.local_shape,
                                      stride=_contiguous_stride(param.local_shape))
    return out


def _param_name(key: str, optimizer: bool) -> str:
    """The parameter a (flattened optimizer) state dict key belongs to."""
    if not optimizer:
        return key
    return key[len("state."):].rpartition(".")[0] if key.startswith("state.") else ""


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, out = 1, []
    for size in reversed(shape):
        out.append(stride)
        stride *= max(size, 1)
    return tuple(reversed(out))


_JOINT: dict[tuple, DeviceMesh] = {}


def _root_mesh(model: nn.Module) -> DeviceMesh | None:
    """The mesh of modelparallel's layout ``model``'s FSDP1 units were built on."""
    for unit in FullyShardedDataParallel.fsdp_modules(model):
        root = lookup(unit, "fsdp1_root_mesh")
        if root is not None:
            return root
    return None


def _joint_mesh(root: DeviceMesh | None, tp_mesh: DeviceMesh,
                data_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh of this rank's tensor-parallel dims (outer: their parts are whole tensors
    FSDP1 then chunks) then FSDP1's data-parallel dims, on the groups of mp's root mesh
    (made once, without communication)."""
    names = (*(tp_mesh.mesh_dim_names or ()), *(data_mesh.mesh_dim_names or ()))
    key = (root, tp_mesh, data_mesh)
    if key in _JOINT:
        return _JOINT[key]
    if root is None or len(names) != tp_mesh.ndim + data_mesh.ndim or \
            not set(names) <= set(root.mesh_dim_names or ()) or len(set(names)) != len(names):
        raise UnsupportedCheckpoint(f"the tensor-parallel mesh {tp_mesh} and FSDP1's mesh "
                                    f"{data_mesh} are not dims of modelparallel's mesh")
    root_names = root.mesh_dim_names or ()
    dims = [root_names.index(n) for n in names]
    rest = [d for d in range(root.ndim) if d not in dims]
    coordinate = root.get_coordinate()
    assert coordinate is not None, "this rank is in modelparallel's mesh"
    outer: tuple[Any, ...] = (..., *(coordinate[d] for d in rest))
    ranks = root.mesh.permute(*dims, *rest)[outer]
    ranks = ranks.contiguous()
    mine = [int(i) for i in (ranks == dist.get_rank()).nonzero()[0]]
    k = tp_mesh.ndim
    tp_line: tuple[Any, ...] = (*[slice(None)] * k, *mine[k:])
    data_line: tuple[Any, ...] = (*mine[:k], ...)
    if ranks[tp_line].tolist() != tp_mesh.mesh.tolist() or \
            ranks[data_line].tolist() != data_mesh.mesh.tolist():
        raise UnsupportedCheckpoint(f"the tensor-parallel mesh {tp_mesh} and FSDP1's mesh "
                                    f"{data_mesh} do not match modelparallel's mesh")
    _JOINT[key] = DeviceMesh.from_group([root.get_group(n) for n in names], root.device_type,
                                        mesh=ranks, mesh_dim_names=names)
    return _JOINT[key]


def install() -> None:
    """Route FSDP1's optimizer-state functions through this module (idempotent)."""
    # the two staticmethods of torch's class, replaced on purpose (see the module docstring)
    FullyShardedDataParallel.optim_state_dict = staticmethod(  # type: ignore[method-assign]
        _optim_state_dict)
    FullyShardedDataParallel.optim_state_dict_to_load = staticmethod(  # type: ignore[method-assign]
        _optim_state_dict_to_load)
