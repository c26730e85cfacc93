"""Tensor and sharded data parallelism on the modules a pipeline rank holds (3D).

Order as DESIGN.md: split into stages first (the caller), then tensor parallelism (with
the precision policy), activation checkpointing, and FSDP2 units bottom-up on what this
rank holds. Modules of other stages keep meta parameters and are never run here (stubs
stand in for them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from modelparallel.context import ParallelContext
from modelparallel.parallel import replicas
from modelparallel.parallel.activation import apply_activation_checkpointing
from modelparallel.parallel.placement import to_device
from modelparallel.parallel.sharding import fully_shard_units
from modelparallel.parallel.tensor.transform import tied_groups, tp_ranks_are_replicas, transform


@dataclass
class Parallelized:
    """What :func:`parallelize` did to a model."""

    fsdp: set[int]      # ids of the parameters FSDP manages (it averages their gradients)
    tp_replicas: bool   # the tensor-parallel ranks hold the model whole: they are replicas


def parallelize(model: nn.Module, units: list[str], s: ParallelContext) -> Parallelized:
    """Start every replica from the first data-parallel rank's values, then tensor
    parallelism per the model's plans, activation checkpointing of the marked modules,
    the precision policy, and one FSDP unit per module path in ``units`` (``""`` = the
    root, last). Modules sharing a parameter (tied embeddings held on one rank) form
    one unit. Parameters are replaced by DTensors."""
    tied = tied_groups(model)
    to_device(model, s.device)  # SMP v1 places each stage on its rank's device
    replicas.synchronize(model, s)  # SMP v1 broadcasts from data-parallel rank 0
    transform(model, s)
    tp_replicas = tp_ranks_are_replicas(model, s.topology.tp)
    apply_activation_checkpointing(model)
    if not s.shards_pipeline_stages:
        return Parallelized(set(), tp_replicas)
    modules = [model.get_submodule(path) for path in units]
    units_of_tied = [group if len(group) > 1 else group[0] for group in _merge_tied(modules)]
    fully_shard_units(units_of_tied, s, tp_replicas=tp_replicas)
    _retie(tied, {id(m) for unit in modules for m in unit.modules()})
    fsdp = {id(p) for path in units for p in model.get_submodule(path).parameters()
            if isinstance(p, DTensor) and p.device_mesh.mesh_dim_names
            and set(p.device_mesh.mesh_dim_names) & {"dp_shard", "dp_replicate"}}
    return Parallelized(fsdp, tp_replicas)


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


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (DTensor or plain)."""
    return t.to_local() if isinstance(t, DTensor) else t
