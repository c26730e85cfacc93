"""One order for turning what a rank holds into its parallel form.

:func:`parallelize` applies, in this order:

1. placement on the rank's device, and every replica starts from the first
   data-parallel rank's values (``replicas.synchronize``, as SMP v1 broadcasts);
   parameters recorded by ``delay_param_initialization`` are allocated and initialised
   here, only those the rank holds, or (with FSDP) unit by unit just before step 4
   shards each unit (``delayed_init``);
2. tensor parallelism per the model's plans, with the precision policy
   (``tensor.transform``);
3. activation checkpointing of the modules marked for it (``activation``), and with
   ``offload_activations`` their inputs offloaded to CPU (``offload_roots``);
4. data parallelism: FSDP2 units bottom-up (``sharding.fully_shard_units``) when the
   configuration shards, else nothing here: the caller's gradient rule averages the
   replicas (``pipeline.gradients.GradientSync``).

The SMP v1 ``DistributedModel`` (through the pipeline engine, on the modules a
pipeline rank holds; other stages' modules keep meta parameters (stand-ins without
values once it is done, ``pipeline.absent``) and stubs stand in for
them) runs all of it at the first step. SMP v2 scripts run the same steps one call at a
time: ``mp.transform`` is step 2, and ``mp.shard`` / ``mp.replicate`` / the FSDP1 hook
are step 4 (each starting with step 1's synchronisation). Where gradients are
averaged is decided in one place for all of them: ``replicas.data_parallel_group``
(docs/architecture.md#gradients).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from modelparallel.context import ParallelContext
from modelparallel.parallel import replicas
from modelparallel.parallel.activation import apply_activation_checkpointing
from modelparallel.parallel.deferred import recipe_of
from modelparallel.parallel.delayed_init import Materializer
from modelparallel.parallel.offload import loading_horizon
from modelparallel.parallel.offload_roots import offload_checkpointed
from modelparallel.parallel.placement import is_meta, on_mesh_dims, to_device
from modelparallel.parallel.sharding import fully_shard_units
from modelparallel.parallel.tensor.transform import tied_groups, tp_ranks_are_replicas, transform


@dataclass
class Parallelized:
    """What :func:`parallelize` did to a model."""

    fsdp: set[int]      # ids of the parameters FSDP manages (it averages their gradients)
    tp_replicas: bool   # the tensor-parallel ranks hold the model whole: they are replicas


def parallelize(model: nn.Module, units: list[str], ctx: ParallelContext) -> Parallelized:
    """Start every replica from the first data-parallel rank's values, then tensor
    parallelism per the model's plans, activation checkpointing of the marked modules,
    the precision policy, and one FSDP unit per module path in ``units`` (``""`` = the
    root, last). Modules sharing a parameter (tied embeddings held on one rank) form
    one unit. Parameters are replaced by DTensors."""
    tied = tied_groups(model)
    to_device(model, ctx.device)  # SMP v1 places each stage on its rank's device
    modules = [model.get_submodule(path) for path in units]
    materialize = _delayed(model, modules, ctx)
    replicas.synchronize(model, ctx)  # SMP v1 broadcasts from data-parallel rank 0
    transform(model, ctx)
    tp_replicas = tp_ranks_are_replicas(model, ctx.topology.tp)
    apply_activation_checkpointing(model)
    if ctx.config.offload_activations:  # SMP v1: the checkpointed layers' inputs to CPU
        offload_checkpointed(model, ctx.device,
                             loading_horizon(ctx.config.activation_loading_horizon, v2=False))
    if not ctx.shards_pipeline_stages:
        return Parallelized(set(), tp_replicas)
    units_of_tied = [group if len(group) > 1 else group[0] for group in _merge_tied(modules)]
    fully_shard_units(units_of_tied, ctx, tp_replicas=tp_replicas, materialize=materialize)
    _retie(tied, {id(m) for unit in modules for m in unit.modules()})
    fsdp = {id(p) for path in units for p in model.get_submodule(path).parameters()
            if on_mesh_dims(p, {"dp_shard", "dp_replicate"})}
    return Parallelized(fsdp, tp_replicas)


def _delayed(model: nn.Module, held: list[nn.Module],
             ctx: ParallelContext) -> Materializer | None:
    """Parameters recorded by ``delay_param_initialization`` that this rank holds: with
    FSDP (and no tensor parallelism, which splits whole tensors) each unit is
    materialised just before it is sharded (returned); otherwise all of them now."""
    if not any(is_meta(p) and recipe_of(p) is not None for m in held for p in m.parameters()):
        return None
    materialize = Materializer(model, ctx, recorded_only=True)
    if ctx.shards_pipeline_stages and ctx.topology.tp == 1:
        return materialize
    for unit in held:
        materialize.allocate(unit)
    return None


def _merge_tied(modules: list[nn.Module]) -> list[list[nn.Module]]:
    """Group modules that share a parameter; FSDP must manage a tensor in one unit. A
    module's parameters inside another (nested) unit belong to that one."""
    groups: list[list[nn.Module]] = []
    owners: dict[int, list[nn.Module]] = {}
    units = {id(m) for m in modules}
    for module in modules:
        own = [p for m in _within(module, units) for p in m.parameters(recurse=False)]
        joined = next((owners[id(p)] for p in own if id(p) in owners), None)
        if joined is None:
            joined = []
            groups.append(joined)
        joined.append(module)
        for p in own:
            owners[id(p)] = joined
    return groups


def _within(unit: nn.Module, units: set[int]) -> list[nn.Module]:
    """``unit`` and its submodules, without the subtrees of other units."""
    found, todo = [], [unit]
    while todo:
        m = todo.pop()
        found.append(m)
        todo += [c for c in m.children() if id(c) not in units]
    return found


def _retie(tied: list[list[tuple[nn.Module, str]]], sharded: set[int]) -> None:
    """After FSDP replaced a tied parameter in a module it shards here, the other users
    (stubbed on this rank) point at the new one too: the model has one tensor again."""
    for users in tied:
        owner = next(((m, n) for m, n in users if id(m) in sharded), None)
        if owner is not None:
            for module, name in users:
                setattr(module, name, getattr(*owner))
