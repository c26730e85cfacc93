"""Expert parallelism under torch's FSDP1 and ``mp.replicate`` (DDP).

Neither wrapper can hold the split experts: FSDP1 flattens a unit's parameters and
reduces them over every data-parallel rank, DDP all-reduces every gradient over them,
while an expert is held by the ``dp / ep`` ranks at the same place of each
expert-parallel group. So the experts modules are FSDP2 units of their own on the
experts' mesh, exactly as under ``mp.shard`` (``sharding.py``: gradients divided by the
whole data-parallel size), and the wrapper of the rest is told to leave them alone:
FSDP1's ``ignored_states``, DDP's ignored parameters. Under FSDP1 the experts follow
``hybrid_shard_degree`` (sharded over the ranks holding the same experts within a
``dp_shard`` group, replicated over the rest); under ``mp.replicate`` they are replicated
over those ranks. Parameters on the meta device (delayed parameter initialization) are
materialised first, each rank keeping its own experts of the whole weights the init
function builds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.fsdp import (
    DataParallelMeshDims,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
)
from torch.nn.parallel import DistributedDataParallel

from modelparallel.context import ParallelContext
from modelparallel.parallel import delayed_init, expert_parallel
from modelparallel.parallel.delayed_init import Materializer
from modelparallel.parallel.expert_parallel.sharding import shard_experts
from modelparallel.parallel.precision import fsdp2_policy
from modelparallel.parallel.replicas import broadcast_from_first

_KEEP_GATHERED = (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2,
                  ShardingStrategy.NO_SHARD)
# every copy of an expert whole: DDP's layout over the ranks holding the same experts
_REPLICATED = DataParallelMeshDims(replicate=("expert_dp_replicate", "expert_dp_shard"))


def for_fsdp1(module: nn.Module, ctx: ParallelContext,
              arguments: dict[str, Any]) -> dict[str, Any]:
    """Shard ``module``'s split experts with FSDP2 before FSDP1 wraps the rest; returns
    FSDP1's constructor ``arguments`` with the experts added to its ``ignored_states``
    (nothing changes without expert parallelism). The experts' copies start from the
    first one's with ``sync_module_states``, as FSDP1 does for the rest."""
    if ctx.topology.ep == 1:
        return arguments
    expert_parallel.require_split(module, ctx, "FullyShardedDataParallel")
    experts = expert_parallel.split_experts(module)
    materialize = _materializer(module, ctx, arguments.get("param_init_fn"))
    if materialize is None and arguments.get("sync_module_states"):
        _synchronize(experts, ctx)
    keep_gathered = arguments.get("sharding_strategy") in _KEEP_GATHERED
    shard_experts(module, ctx, _precision(arguments.get("mixed_precision"), ctx), materialize,
                  reshard_after_forward=not keep_gathered)
    out = dict(arguments)
    if out.get("ignored_modules") is not None:  # FSDP1 takes one of the two
        out["ignored_modules"] = [*out["ignored_modules"], *experts]
        return out
    given = list(out.get("ignored_states") or [])
    if given and isinstance(given[0], nn.Parameter):  # parameters, not modules
        out["ignored_states"] = given + [p for m in experts for p in m.parameters()]
    else:
        out["ignored_states"] = given + experts
    return out


def for_replicate(model: nn.Module, ctx: ParallelContext) -> None:
    """Replicate ``model``'s split experts with FSDP2 over the ranks holding the same
    experts and mark their parameters for DDP to ignore (nothing without expert
    parallelism). Every copy of an expert starts from the first one's, as DDP does."""
    if ctx.topology.ep == 1:
        return
    expert_parallel.require_split(model, ctx, "mp.replicate()")
    experts = expert_parallel.split_experts(model)
    _synchronize(experts, ctx)
    shard_experts(model, ctx, fsdp2_policy(ctx.precision), held_by=_REPLICATED)
    held = {id(p) for m in experts for p in m.parameters()}
    names = [name for name, p in model.named_parameters() if id(p) in held]
    # private, and the only way to keep DDP off some parameters (torch's own callers use it)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


def _precision(given: MixedPrecision | None, ctx: ParallelContext) -> MixedPrecisionPolicy:
    """The experts' FSDP2 precision: the script's FSDP1 ``mixed_precision`` (its layers
    hand the experts hidden states in its ``param_dtype``), else the configuration's."""
    if given is None:
        return fsdp2_policy(ctx.precision)
    return MixedPrecisionPolicy(param_dtype=given.param_dtype, reduce_dtype=given.reduce_dtype)


def _materializer(model: nn.Module, ctx: ParallelContext,
                  init_fn: Callable[[nn.Module], None] | None) -> Materializer | None:
    """What initialises experts on the meta device (on any rank: collective), or None."""
    if not delayed_init.held_anywhere(model, ctx):
        return None
    return Materializer(model, ctx, init_fn)


def _synchronize(experts: list[nn.Module], ctx: ParallelContext) -> None:
    if ctx.expert_replicas_group is not None:
        broadcast_from_first([p for m in experts for p in m.parameters()],
                             ctx.expert_replicas_group)
