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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
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


def shard_experts(model: nn.Module, ctx: ParallelContext, mp_policy: MixedPrecisionPolicy,
                  materialize: Callable[[nn.Module], None] | None = None,
                  **fully_shard_kwargs) -> None:
    """``fully_shard`` each experts module expert parallelism split in ``model`` on the
    mesh of the ranks holding its experts (before its layer's unit); nothing without
    expert parallelism."""
    modules = expert_parallel.split_experts(model)
    if not modules:
        return
    if materialize is not None:
        raise ConfigError([("expert_parallel_degree", (
            f"{ctx.topology.ep} with parameters on the meta device (delayed parameter "
            f"initialization) is not built yet; build the model with real parameters, or "
            f"set expert_parallel_degree to 1"))])
    # the layer's unit has cast the inputs already; the router's weights keep their dtype
    policy = dataclasses.replace(mp_policy, cast_forward_inputs=False)
    divide = divide_by(ctx.topology.ep)
    held_by = DataParallelMeshDims(shard="expert_dp_shard", replicate="expert_dp_replicate")
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


def divide_by(factor: int) -> Callable[[torch.Tensor], None]:
    """FSDP2 all-reduce hook: the reduced gradient divided by ``factor`` more."""

    def hook(reduced: torch.Tensor) -> None:
        reduced.div_(factor)

    return hook
