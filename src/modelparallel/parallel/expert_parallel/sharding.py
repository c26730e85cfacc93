"""FSDP2 over the ranks that hold the same experts, with the gradient averaged over every
data-parallel rank.

Under expert parallelism the ranks of an expert-parallel group hold different experts,
so an experts module cannot join the FSDP unit of its layer (whose reduce-scatter runs
over every data-parallel rank): each is a unit of its own, sharded over the ranks that
hold the same experts (``data-parallel size / ep`` ranks, sharded within a ``dp_shard``
group and replicated over the rest, as torchtitan's ``dp_shard_mod_ep``). Its weights
are DTensors on the experts' mesh (``ep_index`` x those ranks, ``hugging_face.py``), so
FSDP is given that whole mesh and told which of its dims are data-parallel
(``DataParallelMeshDims``): the sharded parameters, their gradients and the optimizer's
state are then DTensors of the whole ``(experts, ...)`` weights.

The gradient: each rank's loss is the mean over its own samples, so one process's
gradient of an expert is the sum of every rank's contribution divided by the
data-parallel size. The backward of the dispatch brings every contribution of an
expert-parallel group to the rank holding the expert, and FSDP's reduction sums over the
ranks holding it; FSDP divides by its mesh's size, ``dp / ep``, so a hook divides by
``ep`` after it. (torch's ``set_gradient_divide_factor`` would say the same, but it
reduces with PREMUL_SUM, which gloo does not have, and torch 2.13 divides twice on a
one-rank mesh outside float32 and bfloat16.)

Parameters on the meta device (delayed parameter initialization) are materialised one
experts module at a time: the init function builds the whole weights and each rank keeps
its own experts (``delayed_init.materialize_module``), every copy of an expert then takes
the first copy's values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (
    DataParallelMeshDims,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from modelparallel.context import ParallelContext
from modelparallel.errors import ConfigError
from modelparallel.parallel import expert_parallel
from modelparallel.parallel.placement import is_meta
from modelparallel.parallel.replicas import broadcast_from_first
from modelparallel.topology import CommGroup

if TYPE_CHECKING:
    from modelparallel.parallel.delayed_init import Materializer

# each expert's copies sharded within a dp_shard group, replicated over the rest
SHARDED = DataParallelMeshDims(shard="expert_dp_shard", replicate="expert_dp_replicate")


def shard_experts(model: nn.Module, ctx: ParallelContext, mp_policy: MixedPrecisionPolicy,
                  materialize: Materializer | None = None,
                  held_by: DataParallelMeshDims = SHARDED, **fully_shard_kwargs) -> None:
    """``fully_shard`` each experts module expert parallelism split in ``model`` on the
    mesh of the ranks holding its experts (before its layer's unit), laid over its
    data-parallel dims as ``held_by`` says; nothing without expert parallelism.
    ``materialize``: the model is on the meta device (see the module's docstring)."""
    modules = expert_parallel.split_experts(model)
    if not modules:
        return
    if materialize is not None:
        _materialize(modules, ctx, materialize)
    # the layer's unit has cast the inputs already; the router's weights keep their dtype
    policy = dataclasses.replace(mp_policy, cast_forward_inputs=False)
    divide = divide_by(ctx.topology.ep)
    for module in modules:
        # the mesh the weights live on: equal to ctx.meshes["experts"], but after an
        # earlier mp.init of another layout in this process torch's sharding cache may
        # give them that init's equal mesh, and fully_shard wants the very object
        weight = next(module.parameters())
        assert isinstance(weight, DTensor), "hugging_face.install made the weights DTensors"
        mesh = weight.device_mesh
        sharded = fully_shard(module, mesh=mesh, dp_mesh_dims=held_by,
                              mp_policy=policy, **fully_shard_kwargs)
        assert isinstance(sharded, FSDPModule)
        sharded.set_all_reduce_hook(divide)


def _materialize(modules: list[nn.Module], ctx: ParallelContext,
                 materialize: Materializer) -> None:
    """Initialise the experts on the meta device, this rank's part of each whole weight,
    and give every copy of an expert the first copy's values. Refused where some ranks
    hold real experts and others do not (rank 0's weights would reach its own experts
    only: the others are held by other ranks)."""
    params = [p for m in modules for p in m.parameters()]
    held = torch.tensor([float(any(is_meta(p) for p in params)),
                         float(not all(is_meta(p) for p in params))])
    dist.all_reduce(held, op=dist.ReduceOp.MAX, group=ctx.process_group(CommGroup.DP_GROUP))
    if held.tolist() == [1.0, 1.0]:
        raise ConfigError([("expert_parallel_degree", (
            f"{ctx.topology.ep} with experts on the meta device on some ranks and real on "
            f"others (weights loaded on rank 0 only) is not built yet: every rank holds "
            f"other experts, so rank 0's cannot reach them; build the model alike on every "
            f"rank (all on the meta device, or all with the weights), or load the weights "
            f"after sharding (tsm.checkpoint / set_model_state_dict)"))])
    for module in modules:
        materialize.allocate(module)
    if ctx.expert_replicas_group is not None:
        broadcast_from_first([p for m in modules for p in m.parameters()],
                             ctx.expert_replicas_group)


def divide_by(factor: int) -> Callable[[torch.Tensor], None]:
    """FSDP2 all-reduce hook: the reduced gradient divided by ``factor`` more."""

    def hook(reduced: torch.Tensor) -> None:
        reduced.div_(factor)

    return hook
