"""Degrees -> a named device mesh, and SMP's rank arithmetic.

:class:`Topology` is pure arithmetic (no processes): which coordinate a rank has on
each mesh dimension and which ranks form each SMP group. :func:`build_mesh` turns it
into one ``DeviceMesh`` with the named dims ``pp, dp_replicate, dp_shard, tp`` in the
order the placement strategy gives.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass

from modelparallel.config import Config

# Letters of placement_strategy -> mesh dims they stand for (outermost first).
LETTER_DIMS = {"D": ("dp_replicate", "dp_shard"), "P": ("pp",), "T": ("tp",)}


class CommGroup(enum.Enum):
    """The process groups of SMP v1."""

    WORLD = "world"
    PP_GROUP = "pp"
    TP_GROUP = "tp"
    DP_GROUP = "dp"  # same pipeline stage: reduced data parallel x tensor parallel
    RDP_GROUP = "rdp"  # same pipeline stage and same tensor-parallel shard
    MP_GROUP = "mp"  # one whole model replica: pipeline x tensor parallel


class RankType(enum.Enum):
    """How a peer rank passed to ``send``/``recv_from`` is interpreted."""

    WORLD_RANK = CommGroup.WORLD
    PP_RANK = CommGroup.PP_GROUP
    TP_RANK = CommGroup.TP_GROUP
    DP_RANK = CommGroup.DP_GROUP
    RDP_RANK = CommGroup.RDP_GROUP
    MP_RANK = CommGroup.MP_GROUP


# Mesh dims each SMP group varies over.
GROUP_DIMS: dict[CommGroup, tuple[str, ...]] = {
    CommGroup.WORLD: ("pp", "dp_replicate", "dp_shard", "tp"),
    CommGroup.PP_GROUP: ("pp",),
    CommGroup.TP_GROUP: ("tp",),
    CommGroup.DP_GROUP: ("dp_replicate", "dp_shard", "tp"),
    CommGroup.RDP_GROUP: ("dp_replicate", "dp_shard"),
    CommGroup.MP_GROUP: ("pp", "tp"),
}


@dataclass(frozen=True)
class Topology:
    """How ``world_size`` ranks are laid out over pp x dp_replicate x dp_shard x tp."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    order: str = "DPT"  # placement strategy as letters, outermost first

    @classmethod
    def from_config(cls, config: Config, world_size: int) -> Topology:
        config.validate_world(world_size)
        dp = config.data_parallel_size(world_size)
        shard = config.shard_size(world_size)
        return cls(pp=config.pipeline_parallel_degree, dp_replicate=dp // shard,
                   dp_shard=shard, tp=config.tensor_parallel_degree,
                   order=config.placement_order)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dim_names(self) -> tuple[str, ...]:
        """Mesh dims, outermost (slowest-varying over ranks) first."""
        return tuple(d for letter in self.order for d in LETTER_DIMS[letter])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.dim_size(d) for d in self.dim_names)

    def dim_size(self, dim: str) -> int:
        return getattr(self, dim)

    def coordinate(self, rank: int) -> dict[str, int]:
        """The index of ``rank`` along every mesh dim."""
        self._check_rank(rank)
        coords = {}
        for dim in reversed(self.dim_names):
            rank, coords[dim] = divmod(rank, self.dim_size(dim))
        return coords

    def rank_at(self, coords: dict[str, int]) -> int:
        rank = 0
        for dim in self.dim_names:
            rank = rank * self.dim_size(dim) + coords[dim]
        return rank

    def group_ranks(self, rank: int, group: CommGroup | Iterable[str]) -> list[int]:
        """Ranks sharing every coordinate with ``rank`` except along the group's dims."""
        dims = GROUP_DIMS[group] if isinstance(group, CommGroup) else tuple(group)
        base = self.coordinate(rank)
        members = []
        for r in range(self.world_size):
            c = self.coordinate(r)
            if all(c[d] == base[d] for d in self.dim_names if d not in dims):
                members.append(r)
        return members

    def all_groups(self, group: CommGroup | Iterable[str]) -> list[list[int]]:
        """Every group of this kind, each as its sorted ranks, ordered by first rank."""
        seen, out = set(), []
        for r in range(self.world_size):
            if r not in seen:
                ranks = self.group_ranks(r, group)
                seen.update(ranks)
                out.append(ranks)
        return out

    def rank_in(self, rank: int, group: CommGroup) -> int:
        """The index of ``rank`` within its group (SMP's tp_rank, dp_rank, ...)."""
        return self.group_ranks(rank, group).index(rank)

    def size_of(self, group: CommGroup) -> int:
        return math.prod(self.dim_size(d) for d in GROUP_DIMS[group])

    def describe(self) -> str:
        dims = " x ".join(f"{d}={self.dim_size(d)}" for d in self.dim_names)
        return f"{self.world_size} ranks: {dims} (placement {self.order})"

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} ranks")


def build_mesh(topology: Topology, device_type: str):
    """Create the DeviceMesh of ``topology`` and a 1-D mesh for every dim and SMP group.

    Needs the default process group. Returns ``(root, meshes)``: the root mesh has the
    four dims of ``topology.dim_names``; ``meshes`` maps ``rdp`` (dp_replicate x
    dp_shard), ``dp`` (rdp x tp), ``mp`` (pp x tp) and each dim name to a 1-D mesh.
    """
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, topology.shape, mesh_dim_names=topology.dim_names)
    meshes = {}
    for group in (CommGroup.RDP_GROUP, CommGroup.DP_GROUP, CommGroup.MP_GROUP):
        dims = tuple(d for d in topology.dim_names if d in GROUP_DIMS[group])
        meshes[group.value] = mesh[dims]._flatten(group.value)
    meshes.update((d, mesh[d]) for d in topology.dim_names)
    return mesh, meshes
