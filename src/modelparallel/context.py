"""ParallelContext: everything the appliers need to know about this rank's layout.

``mp.init()`` makes one from the validated :class:`~modelparallel.config.Config` and
the device mesh; every applier (tensor parallelism, FSDP, the pipeline engine,
checkpoints, metrics) takes it as an argument. It is frozen: a layout does not change
while a model trains. Nothing in the core reads process-wide state; the SMP facade
(:mod:`modelparallel.smp`) holds the one context a SageMaker script expects.
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from modelparallel.config import Config
from modelparallel.precision_policy import PrecisionPolicy
from modelparallel.topology import GROUP_DIMS, CommGroup, DataParallelLayout, Topology, Wrapper

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True, eq=False)
class ParallelContext:
    """This rank's place in the layout: config, topology, mesh, groups and device."""

    config: Config
    topology: Topology
    data_parallel: DataParallelLayout  # how the data-parallel ranks hold a model
    precision: PrecisionPolicy  # the dtypes of parameters, gradients and buffers
    mesh: DeviceMesh  # the root mesh, dims pp x dp_replicate x dp_shard x tp
    # a 1-D mesh per dim and per SMP group (the experts' FSDP mesh may be 2-D)
    meshes: Mapping[str, DeviceMesh]
    device: torch.device
    rank: int
    local_rank: int = 0
    local_size: int = 1
    group_labels: Mapping[str, str] | None = None  # process group name -> our label
    generation: int = 0  # which mp.init() of this process (the same on every rank)
    # numbers this context's collective checkpoint calls, alike on every rank
    checkpoint_calls: Iterator[int] = field(default_factory=itertools.count, repr=False)

    @property
    def collective_timeout(self) -> datetime.timedelta:
        """The configured ``collective_timeout``, for process groups made after init."""
        return datetime.timedelta(seconds=self.config.collective_timeout)

    def coordinate(self, dim: str) -> int:
        """This rank's index on a mesh dim (``pp``, ``dp_replicate``, ``dp_shard``, ``tp``)."""
        return self.topology.coordinate(self.rank)[dim]

    def process_group(self, group: CommGroup) -> dist.ProcessGroup:
        """The torch ProcessGroup of this rank for an SMP group."""
        if group is CommGroup.WORLD:
            world = dist.group.WORLD
            assert world is not None, "the default process group is gone"
            return world
        dims = GROUP_DIMS[group]
        return self.meshes[dims[0] if len(dims) == 1 else group.value].get_group()

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """The context-parallel group of this rank (None without context parallelism)."""
        return self.meshes["cp"].get_group() if "cp" in self.meshes else None

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The expert-parallel group of this rank (None without expert parallelism)."""
        return self.meshes["ep"].get_group() if "ep" in self.meshes else None

    @property
    def expert_replicas_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same experts as this rank (None without expert
        parallelism)."""
        return self.meshes["expert_replicas"].get_group() if "ep" in self.meshes else None

    def expert_data_parallel_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards this rank's experts on: the ranks holding the same experts
        (``Topology.expert_data_parallel_groups``); the data-parallel mesh without expert
        parallelism."""
        return self.meshes.get("expert_dp") or self.data_parallel_mesh()

    def data_parallel_mesh(self) -> DeviceMesh:
        """The mesh FSDP works on: ``dp_shard`` alone, or ``(dp_replicate, dp_shard)``."""
        if self.topology.dp_replicate == 1:
            return self.meshes["dp_shard"]
        return self.mesh["dp_replicate", "dp_shard"]

    @property
    def shards_pipeline_stages(self) -> bool:
        """FSDP over the data-parallel ranks of a DistributedModel, or (False) replicas
        that all-reduce gradients (``DataParallelLayout.model_wrapper``)."""
        return self.data_parallel.model_wrapper is Wrapper.FSDP2

    def gradient_group(self, tp_replicas: bool) -> dist.ProcessGroup:
        """Where a data-parallel gradient is averaged (``DataParallelLayout.averaging``)."""
        return self.process_group(self.data_parallel.averaging(tp_replicas))
