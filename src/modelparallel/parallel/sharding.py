"""Hybrid sharded data parallelism with FSDP2 (``fully_shard``) on the data-parallel mesh.

A model tensor parallelism split has all its parameters made DTensors on the ``tp`` mesh
before ``fully_shard`` (as torchtitan has them): the ones it left whole become
``Replicate()`` there, read by their modules' forwards as the local tensor through a
parameter view (:mod:`~modelparallel.parallel.param_views`). FSDP2 then puts every
parameter on one mesh, ``(dp_shard, tp)`` (with ``dp_replicate`` in front for HSDP), and
torch's own ``clip_grad_norm_(model.parameters(), c)`` returns the global norm (with
some parameters on the 1-D data-parallel mesh it failed: "All operands in
aten.stack.default must have the same mesh"). The gradient of a replicated parameter is
each tensor-parallel rank's own (they compute the same), or summed over ``tp`` by the
view ``regions.py`` adds behind the local one for a parameter read inside a split region.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate

from modelparallel.context import ParallelContext
from modelparallel.parallel import delayed_init, replicas
from modelparallel.parallel.blocks import BlockSpec, find_blocks
from modelparallel.parallel.expert_parallel.sharding import shard_experts
from modelparallel.parallel.param_views import add_view
from modelparallel.parallel.precision import fsdp2_policy, require_loss_scaling
from modelparallel.parallel.tensor.transform import tp_ranks_are_replicas

logger = logging.getLogger("modelparallel")


def fully_shard_units(units: list[nn.Module | list[nn.Module]], ctx: ParallelContext, *,
                      tp_replicas: bool,
                      materialize: Callable[[nn.Module], None] | None = None,
                      **fully_shard_kwargs) -> None:
    """``fully_shard`` each unit (a module, or modules sharing parameters) in order on the
    data-parallel mesh with the config's precision policy. When the tensor-parallel
    ranks are replicas of a whole model, FSDP's average also runs over them.
    ``materialize(module)`` runs on each unit's modules just before it is sharded
    (delayed parameter initialization). A model tensor parallelism split has its
    whole parameters made ``Replicate()`` DTensors on ``tp`` first (the module's
    docstring says why)."""
    fully_shard_kwargs.setdefault("mp_policy", fsdp2_policy(ctx.precision))
    hook = replicas.average_over_tp(ctx) if tp_replicas else None
    split = ctx.topology.tp > 1 and not tp_replicas
    for unit in units:
        modules = unit if isinstance(unit, list) else [unit]
        if materialize is not None:
            for module in modules:
                materialize(module)
        if split:
            replicate_on_tp(modules, ctx.meshes["tp"])
        sharded = fully_shard(unit, mesh=ctx.data_parallel_mesh(), **fully_shard_kwargs)
        if hook is not None:
            assert isinstance(sharded, FSDPModule)
            sharded.set_all_reduce_hook(hook)


def replicate_on_tp(roots: list[nn.Module], mesh: DeviceMesh) -> None:
    """Make the plain parameters of ``roots`` and their submodules ``Replicate()`` DTensors
    on the tensor-parallel ``mesh``; each module's forward reads the local tensor.
    Parameters already DTensors (split, or sharded by an inner FSDP unit) are left."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in {id(m): m for root in roots for m in root.modules()}.values():
        for name, p in module._parameters.items():
            if p is not None and not isinstance(p, DTensor):
                holders.setdefault(id(p), []).append((module, name))
    for users in holders.values():
        module, name = users[0]
        old = module._parameters[name]
        assert old is not None
        new = nn.Parameter(DTensor.from_local(old.detach(), mesh, [Replicate()],
                                              run_check=False), requires_grad=old.requires_grad)
        for module, name in users:  # tied parameters stay one tensor
            module._parameters[name] = new
            add_view(module, _local, [name], pinned=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    """What a module's forward reads of a replicated DTensor parameter: the local tensor
    (pinned in front of the parameter's other views: the sum over ``tp`` that
    ``regions.py`` adds for one read inside a split region then acts on it)."""
    return t.to_local() if isinstance(t, DTensor) else t


def shard(model: nn.Module, ctx: ParallelContext, *, blocks: BlockSpec = None,
          reshard_after_forward: bool | None = None,
          mp_policy: MixedPrecisionPolicy | None = None,
          param_init_fn: Callable[[nn.Module], None] | None = None,
          **fully_shard_kwargs) -> nn.Module:
    """Shard ``model`` with FSDP2 following ``hybrid_shard_degree``; returns the model.

    Every rank first takes the parameters and buffers of the first data-parallel rank
    (as DDP and SMP do). Then ``fully_shard`` is applied bottom-up: each repeated block
    (found automatically, or ``blocks=``: module classes, modules or a predicate), then
    the root. Parameters are sharded over ``dp_shard`` ranks and replicated over
    ``dp_replicate`` ranks (hybrid_shard_degree 0: shard over all data-parallel ranks;
    1: replicate; k: shard over k). ``reshard_after_forward`` goes to every unit
    (default: FSDP's, which reshards the blocks after forward and keeps the root
    gathered for backward; ``False``: ZeRO-2 flavour). ``bf16``/``fp16`` in the config
    select a mixed-precision policy unless ``mp_policy`` is given; with ``fp16`` scale
    the loss with :class:`mp.LossScaler`. A model tensor parallelism did not split is
    trained by the tensor-parallel ranks as data-parallel replicas.

    A model with parameters on the meta device (on any rank: fine-tuning scripts build
    real weights on rank 0 only) is materialised one unit at a time just before that
    unit is sharded, so a rank never holds more than its shards and one unit whole:
    ``param_init_fn(module)`` initialises a module's own parameters, as FSDP1's does
    (``DelayedParamIniter(model).get_param_init_fn()``); without it, parameters recorded
    by ``delay_param_initialization`` replay their recipe and other modules call
    ``reset_parameters()``. Each unit then takes the first data-parallel rank's values.
    """
    say_what_does_not_apply(ctx)
    materialize = None
    if delayed_init.held_anywhere(model, ctx):
        delayed_init.synchronize_buffers(model, ctx)
        materialize = delayed_init.Materializer(model, ctx, param_init_fn)
    else:
        if param_init_fn is not None and ctx.rank == 0:
            logger.warning("mp.shard(param_init_fn=...) has no effect: no parameter is on "
                           "the meta device")
        replicas.synchronize(model, ctx)
    units = find_blocks(model, blocks)
    if not units and ctx.rank == 0:
        logger.warning("mp.shard(): found no repeated blocks in %s; the whole model is one "
                       "FSDP unit (pass blocks=[...] to choose them)", type(model).__name__)
    kwargs = dict(fully_shard_kwargs, reshard_after_forward=reshard_after_forward)
    # experts split over ranks are units of their own, on the ranks holding the same ones
    shard_experts(model, ctx, mp_policy or fsdp2_policy(ctx.precision), materialize, **kwargs)
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    fully_shard_units([*units, model], ctx,
                      tp_replicas=tp_ranks_are_replicas(model, ctx.topology.tp),
                      materialize=materialize, **kwargs)
    if ctx.precision.loss_scaling and mp_policy is None:
        require_loss_scaling(model)
    return model


def say_what_does_not_apply(ctx: ParallelContext, call: str = "mp.shard()") -> None:
    """One line each for keys that do nothing under mp.shard / mp.replicate / a script's
    FSDP1 (rank 0): they are SMP v1's, for models inside mp.DistributedModel."""
    if ctx.rank != 0:
        return
    if ctx.config.microbatches > 1:
        logger.warning("microbatches=%d has no effect on %s: it splits the batches of "
                       "@mp.step functions (mp.DistributedModel)", ctx.config.microbatches, call)
    if ctx.config.offload_activations:
        logger.warning("offload_activations (SMP v1) offloads the checkpointed modules of "
                       "mp.DistributedModel and has no effect on %s; offload with "
                       "sm_activation_offloading and torch's offload_wrapper (SMP v2)", call)
    if call != "mp.shard()":
        return
    if ctx.config.ddp:
        logger.warning("ddp=True has no effect on mp.shard(), which shards with FSDP following "
                       "hybrid_shard_degree (ddp selects replicated data parallelism inside "
                       "mp.DistributedModel; mp.replicate() replicates)")
    if ctx.config.sharded_data_parallel_degree > 1:
        logger.warning("sdp_gradient_clipping is applied by mp.DistributedOptimizer; with "
                       "mp.shard() clip yourself: mp.clip_grad_norm_(model, %s)",
                       ctx.config.sdp_gradient_clipping)
