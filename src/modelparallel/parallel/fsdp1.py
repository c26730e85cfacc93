"""Unchanged FSDP1 scripts follow ``hybrid_shard_degree`` (SMP v2's rules).

After ``mp.init()``, ``FullyShardedDataParallel(model, ...)`` constructed exactly as
before is given our data-parallel process groups:

- ``hybrid_shard_degree`` 0: PyTorch's own behaviour (only ``device_id`` is filled in
  on CPU-only machines, where FSDP1 would otherwise refuse to start);
- 1: ``NO_SHARD`` over the data-parallel ranks;
- k: shard over k ranks. An unset strategy becomes ``HYBRID_SHARD`` (``FULL_SHARD``
  when k is every data-parallel rank); an explicit ``HYBRID_SHARD`` or
  ``_HYBRID_SHARD_ZERO2`` keeps its flavour; ``FULL_SHARD``/``SHARD_GRAD_OP`` become
  their hybrid twins; ``NO_SHARD`` is kept.

With ``tensor_parallel_degree`` > 1:

- a model ``mp.transform`` split (DTensor parameters on the ``tp`` mesh dimension) is
  sharded even where there is nothing to shard over (``hybrid_shard_degree`` 1, one
  data-parallel rank): FSDP1's ``NO_SHARD`` cannot hold DTensor parameters, and a
  sharded strategy over one rank computes the same. Gradient clipping
  (``model.clip_grad_norm_`` and ``mp.clip_grad_norm_``) counts each split parameter
  once over its tensor-parallel ranks; ``SHARDED_STATE_DICT`` holds each
  tensor-parallel rank's part, sharded over the data-parallel ranks (SMP v2 saves one
  checkpoint per tp rank); ``FULL_STATE_DICT`` holds whole tensors, and so does
  ``FSDP.optim_state_dict`` under it (``optim_state_dict_to_load`` takes them back);
  ``mp.save_checkpoint`` saves whole parameters by name (:func:`global_state_dict`),
  so its checkpoints load under any layout;
- a model it left whole trains on each tensor-parallel rank's own batch, so those
  ranks are data-parallel replicas of it too (SMP v1): gradients are averaged over the
  data-parallel x tensor-parallel ranks.

``bf16``/``fp16`` give FSDP1 ``MixedPrecision(param_dtype=<half>,
reduce_dtype=float32)`` unless the script passes its own, which must agree.

An explicit ``process_group`` or ``device_mesh`` is the script's own choice and is
left alone (precision and ``device_id`` still apply).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    FullyShardedDataParallel,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from modelparallel.config import Config, ConfigError
from modelparallel.parallel import fsdp1_limits, fsdp1_torch
from modelparallel.parallel.clip import fsdp1_clip_grad_norm_
from modelparallel.parallel.precision import require_loss_scaling
from modelparallel.state import State, state

logger = logging.getLogger("modelparallel")

_S = ShardingStrategy
_TO_HYBRID = {None: _S.HYBRID_SHARD, _S.FULL_SHARD: _S.HYBRID_SHARD,
              _S.SHARD_GRAD_OP: _S._HYBRID_SHARD_ZERO2, _S.HYBRID_SHARD: _S.HYBRID_SHARD,
              _S._HYBRID_SHARD_ZERO2: _S._HYBRID_SHARD_ZERO2, _S.NO_SHARD: _S.NO_SHARD}
_TO_FLAT = {None: _S.FULL_SHARD, _S.FULL_SHARD: _S.FULL_SHARD,
            _S.SHARD_GRAD_OP: _S.SHARD_GRAD_OP, _S.HYBRID_SHARD: _S.FULL_SHARD,
            _S._HYBRID_SHARD_ZERO2: _S.SHARD_GRAD_OP, _S.NO_SHARD: _S.NO_SHARD}
_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
_original_init = FullyShardedDataParallel.__init__
_signature = inspect.signature(_original_init)


def holds_tensor_parallel(module: nn.Module) -> bool:
    """Whether ``module`` has DTensor parameters on the ``tp`` mesh dimension."""
    return any(isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ())
               for p in module.parameters())


def fsdp1_arguments(s: State, arguments: dict[str, Any], *,
                    split: bool = False) -> dict[str, Any]:
    """The FSDP1 constructor arguments after applying the hybrid sharding policy.

    ``split``: the module holds tensor-parallel DTensor parameters."""
    args = dict(arguments)
    if not torch.cuda.is_available() and args.get("device_id") is None:
        args["device_id"] = torch.device("cpu")
    _apply_precision(s.config, args)
    if args.get("process_group") is not None or args.get("device_mesh") is not None:
        return args  # the script chose its own groups
    cfg, topo = s.config, s.topology
    if cfg.hybrid_shard_degree == 0 and cfg.sharded_data_parallel_degree <= 1 and topo.tp == 1:
        return args  # SMP v2: 0 means PyTorch's own behaviour
    asked = args.get("sharding_strategy")
    no_shard = split and asked is _S.NO_SHARD  # cannot hold tensor-parallel DTensors
    strategy, groups = _layout(s, None if no_shard else asked, split)
    if asked not in (None, strategy) and s.rank == 0:
        why = "FSDP1's NO_SHARD cannot hold tensor-parallel parameters" if no_shard else \
            f"to follow hybrid_shard_degree={topo.dp_shard}" + (
                "" if split or topo.tp == 1 else
                " with the tensor-parallel ranks as replicas of a model they hold whole")
        logger.warning("FSDP sharding_strategy %s becomes %s: %s", asked.name, strategy.name,
                       why)
    args.update(groups, sharding_strategy=strategy)
    return args


def _layout(s: State, asked: ShardingStrategy | None,
            split: bool) -> tuple[ShardingStrategy, dict[str, Any]]:
    """The strategy and the groups: meshes where one has the dims (FSDP1 finds the mesh of
    tensor-parallel DTensor parameters through the data-parallel mesh's root)."""
    topo = s.topology
    replicas = topo.tp > 1 and not split  # TP ranks train a whole model on their own rows
    unsharded = s.meshes["dp" if replicas else "rdp"]
    if topo.dp_shard == 1 and not split:
        return _S.NO_SHARD, {"device_mesh": unsharded}
    if topo.dp_replicate == 1 and not replicas:  # split models: even over one rank
        return _TO_FLAT[asked], {"device_mesh": s.meshes["dp_shard"]}
    strategy = _TO_HYBRID[asked]
    if strategy is _S.NO_SHARD:
        return strategy, {"device_mesh": unsharded}
    if replicas:  # replicate over dp_replicate x tp: no mesh has that dimension
        return strategy, {"process_group": (s.meshes["dp_shard"].get_group(),
                                            _replicate_with_tp_group(s))}
    return strategy, {"device_mesh": s.mesh["dp_replicate", "dp_shard"]}


_GROUPS: dict[tuple, dist.ProcessGroup] = {}


def _replicate_with_tp_group(s: State) -> dist.ProcessGroup:
    """This rank's group over dp_replicate x tp, made once per layout (collective)."""
    key = (s.topology, dist.group.WORLD)
    if key not in _GROUPS:
        ranks = s.topology.all_groups(("dp_replicate", "tp"))
        _GROUPS[key], _ = dist.new_subgroups_by_enumeration(ranks,
                                                             timeout=s.collective_timeout)
    return _GROUPS[key]


def _apply_precision(cfg: Config, args: dict[str, Any]) -> None:
    """``bf16``/``fp16``: compute in the half type, keep float32 parameters and reduce
    gradients in float32 (what ``mp.shard`` does); a script's own policy must agree."""
    key = cfg.half_precision
    if key is None:
        return
    policy = args.get("mixed_precision")
    if policy is None:
        args["mixed_precision"] = MixedPrecision(param_dtype=_HALF[key],
                                                 reduce_dtype=torch.float32)
    elif policy.param_dtype != _HALF[key]:
        raise ConfigError([(key, f"{key}=True computes in {_HALF[key]}, but the script's FSDP "
                                 f"MixedPrecision has param_dtype={policy.param_dtype}; make "
                                 f"them agree or drop one")])


def _full_tensors(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                  local_metadata: Any) -> None:
    """FULL_STATE_DICT: whole tensors, not tensor-parallel DTensors (every rank of a
    tensor-parallel group that returns a state dict gathers together)."""
    settings = FullyShardedDataParallel.get_state_dict_type(module)
    if settings.state_dict_type is not StateDictType.FULL_STATE_DICT:
        return
    for key, value in state_dict.items():
        if key.startswith(prefix) and isinstance(value, DTensor):
            # offloaded to the CPU by FSDP: gather on the mesh's device
            full = value.to(value.device_mesh.device_type).full_tensor()
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
    settings = _full_type(model, split)
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
    settings = _full_type(model, split)
    if settings is not None and optim_state_dict and "state" in optim_state_dict:
        if getattr(settings.optim_state_dict_config, "rank0_only", False):
            raise ValueError("an FSDP1 model with tensor-parallel parameters cannot load a "
                             "full optimizer state with rank0_only=True (rank 0's "
                             "tensor-parallel part would reach every rank); load it on "
                             "every rank with rank0_only=False")
        per_param = dict(optim_state_dict["state"])
        for fqn in sorted(per_param, key=str):
            param = split.get(fqn) if isinstance(fqn, str) else None
            if param is not None:
                per_param[fqn] = {name: _part(value, param)
                                  for name, value in sorted(per_param[fqn].items())}
        optim_state_dict = {**optim_state_dict, "state": per_param}
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
        if not getattr(unit, "_mp_policy", False):
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
        mesh = _joint_mesh(param.mesh, param.data_mesh)
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
        if value.device_mesh != _joint_mesh(param.mesh, param.data_mesh):
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


def _joint_mesh(tp_mesh: DeviceMesh, data_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh of this rank's tensor-parallel dims (outer: their parts are whole tensors
    FSDP1 then chunks) then FSDP1's data-parallel dims, on the groups of mp's root mesh
    (made once, without communication)."""
    root = state.mesh
    names = (*(tp_mesh.mesh_dim_names or ()), *(data_mesh.mesh_dim_names or ()))
    key = (root, tp_mesh, data_mesh)
    if key in _JOINT:
        return _JOINT[key]
    if root is None or len(names) != tp_mesh.ndim + data_mesh.ndim or \
            not set(names) <= set(root.mesh_dim_names or ()) or len(set(names)) != len(names):
        raise UnsupportedCheckpoint(f"the tensor-parallel mesh {tp_mesh} and FSDP1's mesh "
                                    f"{data_mesh} are not dims of modelparallel's mesh")
    dims = [root.mesh_dim_names.index(n) for n in names]
    rest = [d for d in range(root.ndim) if d not in dims]
    coordinate = root.get_coordinate()
    ranks = root.mesh.permute(*dims, *rest)[(..., *(coordinate[d] for d in rest))]
    ranks = ranks.contiguous()
    mine = [int(i) for i in (ranks == dist.get_rank()).nonzero()[0]]
    k = tp_mesh.ndim
    if ranks[(*[slice(None)] * k, *mine[k:])].tolist() != tp_mesh.mesh.tolist() or \
            ranks[(*mine[:k], ...)].tolist() != data_mesh.mesh.tolist():
        raise UnsupportedCheckpoint(f"the tensor-parallel mesh {tp_mesh} and FSDP1's mesh "
                                    f"{data_mesh} do not match modelparallel's mesh")
    _JOINT[key] = DeviceMesh.from_group([root.get_group(n) for n in names], root.device_type,
                                        mesh=ranks, mesh_dim_names=names)
    return _JOINT[key]


def _adopt(model: FullyShardedDataParallel, split: bool) -> None:
    """After construction with our groups: our state dicts, and our clipping when
    tensor parallelism split the model."""
    for unit in FullyShardedDataParallel.fsdp_modules(model):
        unit._mp_policy = True  # read by fsdp1_torch: only models we wrapped are changed
    fsdp1_torch.use_local_state_dicts(model)
    if split:
        model.clip_grad_norm_ = functools.partial(fsdp1_clip_grad_norm_, model)
        model.register_state_dict_post_hook(_full_tensors)


@functools.wraps(_original_init)
def _init_with_policy(self, module, *args, **kwargs):
    if not state.initialized:
        return _original_init(self, module, *args, **kwargs)
    bound = _signature.bind(self, module, *args, **kwargs)
    arguments = {k: v for k, v in bound.arguments.items() if k not in ("self", "module")}
    ours = arguments.get("process_group") is None and arguments.get("device_mesh") is None
    split = state.topology.tp > 1 and holds_tensor_parallel(module)
    final = fsdp1_arguments(state, arguments, split=split)
    if not ours:  # the script's groups, or an auto-wrapped child of a model we wrap
        return _original_init(self, module, **final)
    fsdp1_limits.check_module(module, split)
    with fsdp1_torch.keep_sharded_strategy(split):
        _original_init(self, module, **final)
    _adopt(self, split)
    fsdp1_limits.guard(self, split, bool(final.get("use_orig_params", False)))
    if state.config.half_precision == "fp16":
        require_loss_scaling(self)
    return None


def install() -> None:
    """Route FSDP1 construction through the policy (idempotent; inert before init)."""
    FullyShardedDataParallel.__init__ = _init_with_policy
    FullyShardedDataParallel.optim_state_dict = staticmethod(_optim_state_dict)
    FullyShardedDataParallel.optim_state_dict_to_load = staticmethod(_optim_state_dict_to_load)
    fsdp1_torch.install()
