"""What the FSDP1 path needs from torch's internals, all in this one file.

FSDP1 (``FullyShardedDataParallel``) composes with tensor-parallel DTensor parameters
through private machinery only, so these helpers reach into it. Each says why;
``tests/distributed/test_fsdp1.py::test_fsdp1_internals_we_rely_on`` fails if a torch
release moves what they use.

- :func:`keep_sharded_strategy`: FSDP1 turns any strategy into ``NO_SHARD`` when the
  shard group has one rank, and ``NO_SHARD`` cannot hold tensor-parallel DTensor
  parameters with ``use_orig_params=True`` (it re-creates them as new ``nn.Parameter``
  objects at every step, then fails to write them back: "Cannot writeback when the
  parameter shape changes"). A sharded strategy over one rank computes the same.
  A hybrid strategy over one-rank shard groups stays hybrid: as ``NO_SHARD`` it skipped
  the replicas' all-reduce but kept its divisor (torch's own ``HYBRID_SHARD`` without
  GPUs makes such groups: one "device" per node).
- :func:`_map_param_key_to_optim_keys`: ``FSDP.optim_state_dict`` of flat parameters
  broadcasts the optimizer's keys from *global* rank 0 over the unit's shard group,
  which fails ("Global rank 0 is not part of group") on every other shard group of
  hybrid sharding; there the keys are gathered over the group instead, as torch does
  for ``use_orig_params=True``.
- :func:`_gather_all_orig_param_state`: the optimizer state dicts of such a one-rank
  sharded unit (``use_orig_params=True``) went through torch's shortcut for one rank,
  which returns the state as the optimizer holds it: flat 1-D pieces of the flat
  parameter, not reshaped to the parameters (nor, sharded, made DTensors).
- :func:`use_local_state_dicts`: torch's ``DTensorExtensions`` build sharded state
  dicts on the *root* mesh as if it were ``(dp, tp)``: plain tensors chunked over its
  first dim, tensor-parallel ones over its next-to-last. Ours is ``(dp_replicate,
  dp_shard, pp, tp)``, so entries were chunked over ``dp_replicate`` (or ``pp``).
- :func:`_get_state_dict_2d_layout`, :func:`_create_chunk_sharded_tensor`:
  ``load_sharded_optimizer_state_dict`` (DCP) reads each optimizer state as chunks over
  the *default* group unless the model state dict holds nested ShardedTensors, and
  ``optim_state_dict_to_load`` all-gathers them over FSDP1's shard group. Under tensor
  parallelism (each tp rank reads its own checkpoint) or hybrid sharding that group is
  smaller: states came back as one chunk plus zeros, or chunks of another tp rank's
  checkpoint. Here they are chunked over the shard group of the model's DTensors.
- :func:`grad_pieces`: which part of each original parameter this rank's gradient
  shard holds, and how tensor parallelism split that parameter.
- :func:`split_params`: the original name of every tensor-parallel parameter an FSDP1
  unit flattened, with how tensor parallelism split it (FSDP1 keeps that only in its
  flat parameter), so state dicts can be turned into whole tensors or global DTensors.
- :func:`_set_state_dict_type`: ``offload_to_cpu`` of a model already on the CPU frees
  the only copy of the gathered parameters (FSDP1 "moves" them to where they are, then
  frees the old buffer), so full state dicts read freed memory (SIGSEGV).
- :func:`_unflatten_optim_state_dict`: ``set_optimizer_state_dict`` with
  ``flatten_optimizer_state_dict`` rebuilds each parameter's state from the names in
  the *local* optimizer's state. An FSDP1 rank whose shard holds none of a parameter
  has none, so it dropped the saved state and skipped the all-gather the other ranks
  of its shard group run for that parameter: a hang, or a gloo abort.
- :func:`post_param_init`: SMP v2's FSDP1 takes ``post_param_init_fn(module)``, run on
  each unit's module once ``param_init_fn`` has materialised it (to tie weights before
  FSDP1 flattens them); torch's has no such argument, so its materialisation step
  (``_materialize_with_param_init_fn``) is followed by the function here.
- ``sync_module_states=True`` on a machine without GPUs: torch refuses CPU tensors
  (``_check_module_states_for_sync_module_states``) because it assumes NCCL; the gloo
  group modelparallel uses there broadcasts them.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.optimizer as dcp_optimizer
import torch.distributed.checkpoint.state_dict as dcp_state_dict
import torch.distributed.distributed_c10d as dist_c10d
import torch.distributed.fsdp._common_utils as fsdp_common_utils
import torch.distributed.fsdp._init_utils as fsdp_init_utils
import torch.distributed.fsdp._optim_utils as fsdp_optim_utils
import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp_module
from torch import nn
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, ShardingStrategy
from torch.distributed.tensor import DeviceMesh, DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel.fsdp import DTensorExtensions

from modelparallel.module_state import lookup

# -- one-rank shard groups keep a sharded strategy ---------------------------------------

_keep_sharded = contextvars.ContextVar("mp_fsdp1_keep_sharded", default=False)
_torch_init_core_state = getattr(fsdp_module, "_init_core_state", None)


def _init_core_state(state, sharding_strategy, *args, **kwargs):
    replicas = state.__dict__.get("_inter_node_pg")  # hybrid strategies only
    keep = _keep_sharded.get() or (replicas is not None and replicas.size() > 1)
    if not keep or sharding_strategy in (None, ShardingStrategy.NO_SHARD):
        return _torch_init_core_state(state, sharding_strategy, *args, **kwargs)
    with warnings.catch_warnings():  # "FSDP is switching to use `NO_SHARD` ..."
        warnings.simplefilter("ignore", UserWarning)
        result = _torch_init_core_state(state, sharding_strategy, *args, **kwargs)
    state.sharding_strategy = sharding_strategy  # undo the clamp to NO_SHARD
    return result


def install() -> None:
    """Put the fixes of this module in place (idempotent). One whose torch function is
    gone is skipped here (the internals test names it)."""
    if _torch_init_core_state is not None:
        fsdp_module._init_core_state = _init_core_state
    if _torch_map_optim_keys is not None:
        fsdp_optim_utils._map_param_key_to_optim_keys = _map_param_key_to_optim_keys
    if _torch_gather_all_orig_param_state is not None and all(
            hasattr(fsdp_optim_utils, f) for f in _GATHER_STEPS):
        fsdp_optim_utils._gather_all_orig_param_state = _gather_all_orig_param_state
    FullyShardedDataParallel.set_state_dict_type = staticmethod(  # type: ignore[method-assign]
        _set_state_dict_type)
    if _torch_unflatten_optim_state_dict is not None:
        dcp_state_dict._unflatten_optim_state_dict = _unflatten_optim_state_dict
    if _torch_2d_layout is not None and _torch_chunk_sharded is not None:
        dcp_optimizer._get_state_dict_2d_layout = _get_state_dict_2d_layout
        dcp_optimizer._create_chunk_sharded_tensor = _create_chunk_sharded_tensor
    if _torch_materialize_with_param_init_fn is not None:
        fsdp_init_utils._materialize_with_param_init_fn = _materialize_with_param_init_fn
    if _torch_check_sync_states is not None:
        fsdp_init_utils._check_module_states_for_sync_module_states = _check_sync_states


@contextlib.contextmanager
def keep_sharded_strategy(enabled: bool = True) -> Iterator[None]:
    """While constructing FSDP1 (and its auto-wrapped children), a sharded strategy over a
    one-rank shard group stays sharded instead of becoming ``NO_SHARD``."""
    token = _keep_sharded.set(enabled)
    try:
        yield
    finally:
        _keep_sharded.reset(token)


_torch_map_optim_keys = getattr(fsdp_optim_utils, "_map_param_key_to_optim_keys", None)


def _map_param_key_to_optim_keys(optim_state_dict, group, *args, merge_keys=False, **kwargs):
    if not merge_keys and group is not None and 0 not in dist.get_process_group_ranks(group):
        merge_keys = True  # the same on every rank of the group
    return _torch_map_optim_keys(optim_state_dict, group, *args, merge_keys=merge_keys,
                                 **kwargs)


# private: FSDP1's optimizer state gathering (use_orig_params), and its two steps
_torch_gather_all_orig_param_state = getattr(fsdp_optim_utils,
                                             "_gather_all_orig_param_state", None)
_GATHER_STEPS = ("_allgather_state_info", "_allgather_orig_param_states")


def _gather_all_orig_param_state(fsdp_param_info, input_states, shard_state, to_save,
                                 cpu_offload):
    fsdp_state = fsdp_param_info.state
    if not (lookup(fsdp_state, "fsdp1_policy", False) and fsdp_state.world_size == 1
            and fsdp_state.sharding_strategy != ShardingStrategy.NO_SHARD):
        return _torch_gather_all_orig_param_state(fsdp_param_info, input_states, shard_state,
                                                  to_save, cpu_offload)
    # a sharded unit over one rank: torch's path for several ranks (gathering over one
    # rank copies), which unflattens the states and, for sharded state dicts, chunks them
    info = fsdp_optim_utils._allgather_state_info(fsdp_state, input_states)
    output = fsdp_optim_utils._allgather_orig_param_states(
        fsdp_param_info, info, input_states, shard_state, to_save, cpu_offload)
    if not to_save:
        return {}
    missing = [key for key, i in fsdp_param_info.param_indices.items()
               if key not in output and fsdp_param_info.param_requires_grad[i]]
    if missing:
        raise RuntimeError(f"{missing} are not in the gathered optimizer state")
    return output


# -- sharded state dicts over the data-parallel mesh -------------------------------------

class _LocalShardExtensions(DTensorExtensions):
    """SHARDED_STATE_DICT entries are DTensors over FSDP's own data-parallel mesh (Shard(0)
    on its shard dim) holding this rank's tensor-parallel part whole: each tensor-parallel
    rank has a complete checkpoint of its part, as SMP v2 saves one per tp rank."""

    def chunk_dtensor(self, tensor: torch.Tensor, rank: int, device_mesh: DeviceMesh) -> DTensor:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        whole = [Replicate()] * device_mesh.ndim
        return DTensor.from_local(local.detach().clone(), device_mesh, whole,
                                  run_check=False).redistribute(
            device_mesh, [*whole[:-1], Shard(0)])

    def all_gather_dtensor(self, tensor: DTensor, parent_mesh: DeviceMesh | None) -> torch.Tensor:
        mesh = tensor.device_mesh
        return tensor.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()


# the data-parallel meshes of units given _LocalShardExtensions (DeviceMesh hashes by value)
_LOCAL_MESHES: weakref.WeakSet[DeviceMesh] = weakref.WeakSet()


def use_local_state_dicts(model: nn.Module) -> None:
    """Give every FSDP1 unit of ``model`` built on a device mesh :class:`_LocalShardExtensions`
    (its flattening of tensor-parallel parameters is torch's own, inherited)."""
    for unit in FullyShardedDataParallel.fsdp_modules(model):
        old: Any = unit._fsdp_extension  # private: set by FSDP1's _init_extension
        if unit._device_mesh is not None and old is not None:
            unit._fsdp_extension = _LocalShardExtensions(old.device_handle)
            _LOCAL_MESHES.add(unit._device_mesh)


_torch_2d_layout = getattr(dcp_optimizer, "_get_state_dict_2d_layout", None)
_torch_chunk_sharded = getattr(dcp_optimizer, "_create_chunk_sharded_tensor", None)
# the shard group of the model state dict the running load_sharded_optimizer_state_dict
# was given (set by its first step, read by the next ones, within the same call)
_optim_load_group: list[Any] = [None]


def _get_state_dict_2d_layout(state_dict):
    layout, group = _torch_2d_layout(state_dict)
    _optim_load_group[0] = None
    meshes = {v.device_mesh for v in state_dict.values() if isinstance(v, DTensor)  # not
              and "ep_index" not in (v.device_mesh.mesh_dim_names or ())}  # FSDP2's experts
    if group is None and meshes and all(m in _LOCAL_MESHES for m in meshes):
        # _LocalShardExtensions shards on the mesh's last dim, the group FSDP1 gathers over
        groups = {m.get_group(m.ndim - 1) for m in meshes}
        _optim_load_group[0] = groups.pop() if len(groups) == 1 else None
    return layout, group


def _create_chunk_sharded_tensor(tensor, rank, world_size, num_devices_per_node, pg,
                                 device=None):
    group = _optim_load_group[0]
    if group is not None and pg is dist_c10d._get_default_group():
        # chunks over the ranks sharing this checkpoint, as FSDP1 will gather them
        rank, world_size, pg = dist.get_rank(group), group.size(), group
    return _torch_chunk_sharded(tensor, rank, world_size, num_devices_per_node, pg, device)


# -- gradient shards ---------------------------------------------------------------------

@dataclasses.dataclass
class GradPiece:
    grad: torch.Tensor | None  # this rank's part of the parameter's gradient, if any
    split: tuple[object, ...]  # process groups of the mesh dims tensor parallelism shards it on
    sharded: object | None  # FSDP's shard group when FSDP shards it, else None


def grad_pieces(model: nn.Module) -> tuple[list[GradPiece], list[nn.Parameter]]:
    """One :class:`GradPiece` per parameter each FSDP1 unit of ``model`` manages (on every
    rank, in the same order), and the parameters of ``model`` no unit manages."""
    pieces: list[GradPiece] = []
    managed: set[Any] = set()
    for unit in FullyShardedDataParallel.fsdp_modules(model):
        handle = unit._handle  # private: the unit's FlatParamHandle, None if it has no params
        if handle is None:
            continue
        flat: Any = handle.flat_param  # private FlatParameter internals below
        managed.add(flat)
        sharded = unit.process_group if handle.uses_sharded_strategy else None
        flat_grad = flat.grad
        for i, (info, spec) in enumerate(zip(flat._shard_param_infos, flat._param_extensions,
                                             strict=True)):
            if handle._use_orig_params:
                param = flat._params[i]
                managed.add(param)
                grad = param.grad if info.in_shard else None
            elif info.in_shard and flat_grad is not None:
                start = info.offset_in_shard
                grad = flat_grad[start:start + info.numel_in_shard]
            else:
                grad = None
            split = () if spec is None else tuple(
                spec.mesh.get_group(d) for d, p in enumerate(spec.placements) if p.is_shard())
            pieces.append(GradPiece(grad, split, sharded))
    unmanaged = [p for p in model.parameters() if p not in managed]
    return pieces, unmanaged


def holds_split_params(model: nn.Module) -> bool:
    """Whether some FSDP1 unit of ``model`` flattened tensor-parallel DTensor parameters."""
    return any(unit._handle is not None
               and any(s is not None for s in unit._handle.flat_param._param_extensions)
               for unit in FullyShardedDataParallel.fsdp_modules(model))


@dataclasses.dataclass(frozen=True)
class SplitParam:
    """A tensor-parallel parameter as FSDP1 flattened it."""
    mesh: DeviceMesh  # tensor parallelism's mesh
    placements: tuple[Placement, ...]  # on ``mesh``
    shape: torch.Size  # the whole parameter
    stride: tuple[int, ...]
    local_shape: torch.Size  # this rank's tensor-parallel part (what FSDP1 flattened)
    data_mesh: DeviceMesh | None  # the unit's data-parallel mesh (None: process groups)


def split_params(model: nn.Module) -> dict[str, SplitParam]:
    """Original (state dict) name -> :class:`SplitParam`, for every tensor-parallel
    parameter of the FSDP1 units of ``model`` built by our policy, tied names included.
    The same on every rank of a tensor-parallel group, in the model's order."""
    out: dict[str, SplitParam] = {}
    for prefix, unit in model.named_modules():
        if not isinstance(unit, FullyShardedDataParallel) or \
                not lookup(unit, "fsdp1_policy", False) or unit._handle is None:
            continue
        flat = unit._handle.flat_param  # private: FlatParameter metadata, one per original
        found: dict[str, SplitParam] = {}
        for fqn, shape, spec in zip(flat._fqns, flat._shapes, flat._param_extensions,
                                    strict=True):
            if spec is None:  # not a DTensor: FSDP1 flattened it whole
                continue
            found[fqn] = SplitParam(spec.mesh, tuple(spec.placements), spec.tensor_meta.shape,
                                    tuple(spec.tensor_meta.stride), torch.Size(shape),
                                    unit._device_mesh)
        for shared in flat._shared_param_infos:  # tied parameters: the other names
            primary = _join(shared.prim_module_name, shared.prim_param_name)
            if primary in found:
                found[_join(shared.module_name, shared.param_name)] = found[primary]
        for fqn, split in found.items():
            # clean_tensor_name (private): drops FSDP's and activation checkpointing's
            # wrapper prefixes, as FSDP1's own state dicts name parameters
            out[fsdp_common_utils.clean_tensor_name(_join(prefix, fqn))] = split
    return out


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# -- full state dicts of models on the CPU -----------------------------------------------

_torch_set_state_dict_type = FullyShardedDataParallel.set_state_dict_type


def _set_state_dict_type(module, state_dict_type, state_dict_config=None,
                         optim_state_dict_config=None):
    if (isinstance(state_dict_config, FullStateDictConfig) and state_dict_config.offload_to_cpu
            and _on_cpu(module)):
        # already on the CPU: nothing to offload (and offloading would free the only copy)
        state_dict_config = dataclasses.replace(state_dict_config, offload_to_cpu=False)
    return _torch_set_state_dict_type(module, state_dict_type, state_dict_config,
                                      optim_state_dict_config)


def _on_cpu(module: nn.Module) -> bool:
    units = [u for u in FullyShardedDataParallel.fsdp_modules(module)
             if lookup(u, "fsdp1_policy", False)]
    return bool(units) and all(p.device.type == "cpu" for u in units for p in u.parameters())


# -- flattened optimizer state dicts (torch.distributed.checkpoint.state_dict) -----------

_torch_unflatten_optim_state_dict = getattr(dcp_state_dict, "_unflatten_optim_state_dict",
                                            None)


def _unflatten_optim_state_dict(optim, state_dict, info):
    osd = _torch_unflatten_optim_state_dict(optim, state_dict, info)
    if not any(lookup(m, "fsdp1_policy", False) for m in info.fsdp_modules):
        return osd
    saved: dict[str, dict[str, object]] = {}  # "state.<fqn>" -> {state name: value}
    for key, value in state_dict.items():
        if key.startswith("state."):
            owner, _, name = key.rpartition(".")
            saved.setdefault(owner, {})[name] = value
    for fqn, param_state in osd["state"].items():
        for name, value in saved.get(f"state.{fqn}", {}).items():
            param_state.setdefault(name, value)  # the names this rank's optimizer lacks
    return osd


# -- post_param_init_fn, and sync_module_states without GPUs -----------------------------

_post_param_init = contextvars.ContextVar("mp_fsdp1_post_param_init", default=None)
_torch_materialize_with_param_init_fn = getattr(fsdp_init_utils,
                                                "_materialize_with_param_init_fn", None)
_torch_check_sync_states = getattr(fsdp_init_utils,
                                   "_check_module_states_for_sync_module_states", None)


def _materialize_with_param_init_fn(root_module, param_init_fn, ignored_modules):
    _torch_materialize_with_param_init_fn(root_module, param_init_fn, ignored_modules)
    post = _post_param_init.get()
    if post is not None:
        post(root_module)


@contextlib.contextmanager
def post_param_init(fn: Any) -> Iterator[None]:
    """While constructing FSDP1 (and its auto-wrapped children), ``fn(module)`` runs on
    each unit's module after ``param_init_fn`` materialised it (SMP v2's
    ``post_param_init_fn``)."""
    if fn is not None and not callable(fn):
        raise ValueError(f"post_param_init_fn must be callable, got {fn!r}")
    token = _post_param_init.set(fn)
    try:
        yield
    finally:
        _post_param_init.reset(token)


def _check_sync_states(module_states):
    if torch.cuda.is_available():
        _torch_check_sync_states(module_states)
