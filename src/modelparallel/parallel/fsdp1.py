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

import functools
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (
    FullyShardedDataParallel,
    ShardingStrategy,
)

from modelparallel.context import ParallelContext
from modelparallel.module_state import state_of
from modelparallel.parallel import (
    expert_parallel,
    fsdp1_limits,
    fsdp1_state,
    fsdp1_torch,
    stale_params,
    unused_grads,
)
from modelparallel.parallel.clip import fsdp1_clip_grad_norm_
from modelparallel.parallel.placement import holds_tensor_parallel
from modelparallel.parallel.precision import fsdp1_policy, require_loss_scaling
from modelparallel.parallel.sharding import say_what_does_not_apply

logger = logging.getLogger("modelparallel")

_S = ShardingStrategy
_TO_HYBRID = {None: _S.HYBRID_SHARD, _S.FULL_SHARD: _S.HYBRID_SHARD,
              _S.SHARD_GRAD_OP: _S._HYBRID_SHARD_ZERO2, _S.HYBRID_SHARD: _S.HYBRID_SHARD,
              _S._HYBRID_SHARD_ZERO2: _S._HYBRID_SHARD_ZERO2, _S.NO_SHARD: _S.NO_SHARD}
_TO_FLAT = {None: _S.FULL_SHARD, _S.FULL_SHARD: _S.FULL_SHARD,
            _S.SHARD_GRAD_OP: _S.SHARD_GRAD_OP, _S.HYBRID_SHARD: _S.FULL_SHARD,
            _S._HYBRID_SHARD_ZERO2: _S.SHARD_GRAD_OP, _S.NO_SHARD: _S.NO_SHARD}


def fsdp1_arguments(ctx: ParallelContext, arguments: dict[str, Any], *,
                    split: bool = False) -> dict[str, Any]:
    """The FSDP1 constructor arguments after applying the hybrid sharding policy.

    ``split``: the module holds tensor-parallel DTensor parameters."""
    args = dict(arguments)
    if not torch.cuda.is_available() and args.get("device_id") is None:
        args["device_id"] = torch.device("cpu")
    if ctx.precision.mixed:
        args["mixed_precision"] = fsdp1_policy(ctx.precision, args.get("mixed_precision"),
                                               ctx.config.half_precision or "")
    if args.get("process_group") is not None or args.get("device_mesh") is not None:
        return args  # the script chose its own groups
    topo = ctx.topology
    if not ctx.data_parallel.sets_shard_layout and topo.tp == 1:
        return args  # SMP v2: hybrid_shard_degree 0 means PyTorch's own behaviour
    asked = args.get("sharding_strategy")
    no_shard = split and asked is _S.NO_SHARD  # cannot hold tensor-parallel DTensors
    strategy, groups = _layout(ctx, None if no_shard else asked, split)
    if asked not in (None, strategy) and ctx.rank == 0:
        why = "FSDP1's NO_SHARD cannot hold tensor-parallel parameters" if no_shard else \
            f"to follow hybrid_shard_degree={ctx.data_parallel.shard_size}" + (
                "" if split or topo.tp == 1 else
                " with the tensor-parallel ranks as replicas of a model they hold whole")
        logger.warning("FSDP sharding_strategy %s becomes %s: %s", asked.name, strategy.name,
                       why)
    args.update(groups, sharding_strategy=strategy)
    return args


def _layout(ctx: ParallelContext, asked: ShardingStrategy | None,
            split: bool) -> tuple[ShardingStrategy, dict[str, Any]]:
    """The strategy and the groups: meshes where one has the dims (FSDP1 finds the mesh of
    tensor-parallel DTensor parameters through the data-parallel mesh's root)."""
    layout = ctx.data_parallel
    replicas = ctx.topology.tp > 1 and not split  # TP ranks train a whole model on their rows
    unsharded = ctx.meshes[layout.averaging(replicas).value]
    if layout.shard_size == 1 and not split:
        return _S.NO_SHARD, {"device_mesh": unsharded}
    if layout.replicas == 1 and not replicas:  # split models: even over one rank
        return _TO_FLAT[asked], {"device_mesh": ctx.meshes["dp_shard"]}
    strategy = _TO_HYBRID[asked]
    if strategy is _S.NO_SHARD:
        return strategy, {"device_mesh": unsharded}
    if replicas:  # replicate over dp_replicate x tp: no mesh has that dimension
        return strategy, {"process_group": (ctx.meshes["dp_shard"].get_group(),
                                            _replicate_with_tp_group(ctx))}
    return strategy, {"device_mesh": ctx.mesh["dp_replicate", "dp_shard"]}


_GROUPS: dict[tuple, dist.ProcessGroup] = {}


def _replicate_with_tp_group(ctx: ParallelContext) -> dist.ProcessGroup:
    """This rank's group over dp_replicate x tp, made once per layout (collective)."""
    key = (ctx.topology, dist.group.WORLD)
    if key not in _GROUPS:
        ranks = ctx.topology.all_groups(("dp_replicate", "tp"))
        _GROUPS[key], _ = dist.new_subgroups_by_enumeration(ranks,
                                                             timeout=ctx.collective_timeout)
    return _GROUPS[key]


def _adopt(model: FullyShardedDataParallel, split: bool, ctx: ParallelContext) -> None:
    """After construction with our groups: our state dicts, and our clipping when
    tensor parallelism split the model or expert parallelism its experts (FSDP2 units
    FSDP1 ignores: DTensors on the experts' mesh)."""
    for unit in FullyShardedDataParallel.fsdp_modules(model):
        state = state_of(unit)
        state.fsdp1_policy = True  # read by fsdp1_torch: only models we wrapped are changed
        state.fsdp1_root_mesh = ctx.mesh  # whole-tensor state dicts are laid on it (fsdp1_state)
    fsdp1_torch.use_local_state_dicts(model)
    if split or expert_parallel.split_experts(model.module):  # FSDP1's own misses them
        model.clip_grad_norm_ = functools.partial(  # type: ignore[method-assign]
            fsdp1_clip_grad_norm_, model)
        model.register_state_dict_post_hook(fsdp1_state.full_tensors)


def construct(fsdp: FullyShardedDataParallel, module: nn.Module, arguments: dict[str, Any],
              ctx: ParallelContext, original_init: Any) -> None:
    """Run FSDP1's own ``original_init`` on ``fsdp`` with ``arguments`` (the script's,
    by name) after applying the policy of ``ctx`` (see the module's docstring)."""
    ours = arguments.get("process_group") is None and arguments.get("device_mesh") is None
    split = ctx.topology.tp > 1 and holds_tensor_parallel(module)
    final = fsdp1_arguments(ctx, arguments, split=split)
    if not ours:  # the script's groups, or an auto-wrapped child of a model we wrap
        original_init(fsdp, module, **final)
        return
    fsdp1_limits.check_module(module, split)
    say_what_does_not_apply(ctx, "FullyShardedDataParallel")
    before = dict(module.named_parameters())
    with fsdp1_torch.keep_sharded_strategy(split):
        original_init(fsdp, module, **final)
    stale_params.record_replaced(before, fsdp, "FullyShardedDataParallel")
    _adopt(fsdp, split, ctx)
    fsdp1_limits.guard(fsdp, split, bool(final.get("use_orig_params", False)))
    # parameters no data-parallel rank used keep no gradient, as in one process
    tp_replicas = ctx.topology.tp > 1 and not split
    unused_grads.track_fsdp1(fsdp, ctx.gradient_group(tp_replicas), ctx.device)
    if ctx.precision.loss_scaling:
        require_loss_scaling(fsdp)
