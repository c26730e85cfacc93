"""Degrees -> a named device mesh, and SMP's rank arithmetic: the layout decided once.

Everything the degrees mean for a world size is worked out here and nowhere else:
:func:`check_world` checks them against it, :meth:`Topology.from_config` lays the ranks
out, and :class:`DataParallelLayout` says how the data-parallel ranks hold a model (the
shard size, and what ``hybrid_shard_degree`` and ``ddp`` ask of each API).
:class:`Topology` is pure arithmetic (no processes): which coordinate a rank has on each
mesh dimension and which ranks form each SMP group. :func:`build_mesh` turns it into one
``DeviceMesh`` with the named dims ``pp, dp_replicate, dp_shard, tp`` in the order the
placement strategy gives.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass

from modelparallel import schedule_rules
from modelparallel.config import DEGREE_KEYS, Config
from modelparallel.errors import ConfigError

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


class Wrapper(enum.Enum):
    """What holds a model's data-parallel copies."""

    FSDP2 = "fsdp2"  # torch's fully_shard (mp.shard, DistributedModel when sharding)
    FSDP1 = "fsdp1"  # torch's FullyShardedDataParallel, as scripts call it
    DDP = "ddp"  # torch's DistributedDataParallel (mp.replicate)
    REPLICAS = "replicas"  # DistributedModel all-reduces whole gradients itself


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
    """How ``world_size`` ranks are laid out over pp x dp_replicate x dp_shard x tp.

    ``cp`` context-parallel ranks split each sequence: they are consecutive ranks of a
    ``dp_shard`` group (they shard the model together, as in SMP v2, and their gradients
    are averaged with the other data-parallel ranks'), and read the same samples.
    """

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    order: str = "DPT"  # placement strategy as letters, outermost first
    cp: int = 1  # a divisor of dp_shard
    ep: int = 1  # a divisor of dp_replicate x dp_shard

    @classmethod
    def from_config(cls, config: Config, world_size: int) -> Topology:
        """The layout of ``world_size`` ranks under ``config`` (checked against it)."""
        check_world(config, world_size)
        dp = data_parallel_size(config, world_size)
        shard = shard_size(config, world_size)
        return cls(pp=config.pipeline_parallel_degree, dp_replicate=dp // shard,
                   dp_shard=shard, tp=config.tensor_parallel_degree,
                   order=config.placement_order, cp=config.context_parallel_degree,
                   ep=config.expert_parallel_degree)

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

    def cp_rank(self, rank: int) -> int:
        """The index of ``rank`` in its context-parallel group."""
        return self.coordinate(rank)["dp_shard"] % self.cp

    def cp_groups(self) -> list[list[int]]:
        """Every context-parallel group, as its ranks in cp-rank order."""
        return [shard[i:i + self.cp] for shard in self.all_groups(("dp_shard",))
                for i in range(0, len(shard), self.cp)]

    def ep_groups(self) -> list[list[int]]:
        """Every expert-parallel group, as its ranks in ep-rank order: consecutive ranks of
        each reduced data-parallel group (within a ``dp_shard`` group when ``ep`` divides
        it, as torchtitan lays them out)."""
        return [rdp[i:i + self.ep] for rdp in self.all_groups(CommGroup.RDP_GROUP)
                for i in range(0, len(rdp), self.ep)]

    def ep_rank(self, rank: int) -> int:
        """The index of ``rank`` in its expert-parallel group (which experts it holds)."""
        return self.rank_in(rank, CommGroup.RDP_GROUP) % self.ep

    @property
    def expert_shard(self) -> int:
        """Ranks an expert's parameters are sharded over: ``dp_shard / ep`` when ``ep``
        divides ``dp_shard``, else 1 (the ranks holding an expert then lie in different
        ``dp_shard`` groups, and replicate it)."""
        return self.dp_shard // self.ep if self.dp_shard % self.ep == 0 else 1

    def expert_data_parallel_groups(self) -> list[list[list[int]]]:
        """The ranks that hold the same experts (one per expert-parallel group), each as
        ``[replica][shard]``: the mesh FSDP shards the experts on (``expert_shard``
        ranks, replicated over the rest)."""
        out = []
        for rdp in self.all_groups(CommGroup.RDP_GROUP):
            for i in range(self.ep):
                same = rdp[i::self.ep]
                out.append([same[j:j + self.expert_shard]
                            for j in range(0, len(same), self.expert_shard)])
        return out

    def reading_rank(self, rank: int, group: CommGroup) -> tuple[int, int]:
        """``(index, count)`` of the samples ``rank`` reads among the ranks of ``group``
        that read different samples: ``group``'s index and size, except that the ranks
        of a context-parallel group read the same samples."""
        if self.cp == 1:
            return self.rank_in(rank, group), self.size_of(group)

        def samples(r: int) -> tuple[tuple[str, int], ...]:  # cp rank left out
            c = self.coordinate(r)
            c["dp_shard"] //= self.cp
            return tuple(sorted(c.items()))

        readers = list(dict.fromkeys(samples(r) for r in self.group_ranks(rank, group)))
        return readers.index(samples(rank)), len(readers)

    def describe(self) -> str:
        dims = " x ".join(f"{d}={self.dim_size(d)}" for d in self.dim_names)
        cp = f", cp={self.cp} within dp_shard" if self.cp > 1 else ""
        ep = f", ep={self.ep} over data-parallel ranks" if self.ep > 1 else ""
        return f"{self.world_size} ranks: {dims}{cp}{ep} (placement {self.order})"

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} ranks")


def build_mesh(topology: Topology, device_type: str):
    """Create the DeviceMesh of ``topology`` and a 1-D mesh for every dim and SMP group.

    Needs the default process group. Returns ``(root, meshes)``: the root mesh has the
    four dims of ``topology.dim_names``; ``meshes`` maps ``rdp`` (dp_replicate x
    dp_shard), ``dp`` (rdp x tp), ``mp`` (pp x tp), each dim name and, with context
    parallelism, ``cp`` to a 1-D mesh; with expert parallelism ``ep`` (a 1-D mesh) and
    ``expert_dp``, the mesh an expert's copies are sharded on: ``expert_dp_shard`` alone,
    or ``(expert_dp_replicate, expert_dp_shard)``, ``expert_replicas``, those ranks as
    a 1-D mesh, and ``experts``, the 3-D mesh ``(ep_index, expert_dp_replicate,
    expert_dp_shard)`` the experts' DTensors live on.
    """
    import torch
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    mesh = init_device_mesh(device_type, topology.shape, mesh_dim_names=topology.dim_names)
    meshes = {}
    for group in (CommGroup.RDP_GROUP, CommGroup.DP_GROUP, CommGroup.MP_GROUP):
        dims = tuple(d for d in topology.dim_names if d in GROUP_DIMS[group])
        meshes[group.value] = mesh[dims]._flatten(group.value)
    meshes.update((d, mesh[d]) for d in topology.dim_names)
    if topology.cp > 1:  # consecutive ranks of dp_shard: no dim of the root mesh
        groups = torch.tensor(topology.cp_groups())
        meshes["cp"] = DeviceMesh(device_type, groups, mesh_dim_names=("cp_groups", "cp"))["cp"]
    if topology.ep > 1:  # consecutive data-parallel ranks: no dim of the root mesh either
        groups = torch.tensor(topology.ep_groups())
        meshes["ep"] = DeviceMesh(device_type, groups, mesh_dim_names=("ep_groups", "ep"))["ep"]
        held = torch.tensor(topology.expert_data_parallel_groups())
        names = ("ep_index", "expert_dp_replicate", "expert_dp_shard")
        # one (ep_index, replicas, shards) block per reduced data-parallel group (per
        # tensor-parallel rank): a 3-D mesh of all of them would put the tensor-parallel
        # ranks on ep_index too
        blocks = held.view(-1, topology.ep, *held.shape[1:])
        experts = DeviceMesh(device_type, blocks,
                             mesh_dim_names=("expert_groups", *names))[names]
        meshes["experts"] = experts
        meshes["expert_dp"] = experts[names[2]] if held.shape[1] == 1 else experts[names[1:]]
        meshes["expert_replicas"] = DeviceMesh(
            device_type, held.flatten(1), mesh_dim_names=("ep_index", "expert_replicas"),
        )["expert_replicas"]
    return mesh, meshes


# -- what the degrees mean for a world size ----------------------------------------------

def data_parallel_size(config: Config, world_size: int) -> int:
    """Ranks that hold the same model part: world / (pp x tp x ep) (context-parallel
    ranks included)."""
    return world_size // config.model_parallel_product()


def shard_size(config: Config, world_size: int) -> int:
    """dp_shard: ranks one parameter is sharded over (1 = replicated)."""
    degree = config.shard_degree
    return data_parallel_size(config, world_size) if degree == 0 else degree


def check_world(config: Config, world_size: int) -> None:
    """Check the degrees against a world size; raise ConfigError naming every problem."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError([("world_size", f"{world_size!r} is not a number of processes; "
                                          f"use an integer >= 1")])
    problems: list[tuple[str, str]] = []
    product = config.model_parallel_product()
    if world_size % product:
        factors = " x ".join(
            f"{k}={getattr(config, k)}" for k in DEGREE_KEYS
            if getattr(config, k) > 1 and k in ("pipeline_parallel_degree",
                                                 "tensor_parallel_degree"))
        problems.append((
            "tensor_parallel_degree" if config.tensor_parallel_degree > 1
            else "pipeline_parallel_degree",
            f"{factors} = {product} does not divide the world size {world_size}; "
            f"use degrees whose product divides {world_size}, or launch a multiple "
            f"of {product} processes"))
    else:
        dp = world_size // product
        degree = config.shard_degree
        key = "hybrid_shard_degree" if config.hybrid_shard_degree else \
            "sharded_data_parallel_degree"
        if degree and dp % degree:
            # sharded_data_parallel_degree has no 0 ("all ranks"); its minimum is 1
            zero = [0] if key == "hybrid_shard_degree" else []
            valid = ", ".join(str(d) for d in [*zero, *_divisors(dp)])
            problems.append((key, f"{degree} does not divide the data-parallel size {dp} "
                                  f"(world size {world_size} / {product} model-parallel "
                                  f"ranks); valid values: {valid}"))
        elif config.pipeline_parallel_degree > 1 and \
                _pipeline_shards(config, degree or dp):
            problems += schedule_rules.check_sharded_stages(config.pipeline, degree or dp)
        elif (degree or dp) % config.context_parallel_degree:
            problems.append(_context_parallel_problem(config, degree, dp))
        if dp % config.expert_parallel_degree:
            problems.append(("expert_parallel_degree",
                             f"{config.expert_parallel_degree} does not divide the "
                             f"data-parallel size {dp} (world size {world_size} / {product} "
                             f"model-parallel ranks): the experts are split over "
                             f"data-parallel ranks; valid values: "
                             f"{', '.join(map(str, _divisors(dp)))}"))
    if problems:
        raise ConfigError(problems)


def _context_parallel_problem(config: Config, degree: int, dp: int) -> tuple[str, str]:
    """SMP's rule: the ranks of a context-parallel group shard the model together, so the
    context-parallel degree divides the shard degree."""
    cp = config.context_parallel_degree
    if not degree:
        return ("context_parallel_degree",
                f"{cp} does not divide the {dp} data-parallel ranks the model is sharded over "
                f"(hybrid_shard_degree=0); valid values: {', '.join(map(str, _divisors(dp)))}")
    key = "hybrid_shard_degree" if config.hybrid_shard_degree else \
        "sharded_data_parallel_degree"
    multiples = [d for d in [0, *_divisors(dp)] if d == 0 or d % cp == 0]
    return (key, f"{degree} is not a multiple of context_parallel_degree={cp}: the ranks of a "
                 f"context-parallel group shard the model together (as in SMP v2, "
                 f"context_parallel_degree <= hybrid_shard_degree); valid values: "
                 f"{', '.join(map(str, multiples))}")


def fits(config: Config, world_size: int) -> bool:
    """Whether ``config``'s degrees lay out ``world_size`` ranks (:func:`check_world`)."""
    try:
        check_world(config, world_size)
    except ConfigError:
        return False
    return True


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _explicit_sharding(config: Config) -> bool:
    return config.sharded_data_parallel_degree > 1 or config.hybrid_shard_degree >= 2


def _pipeline_shards(config: Config, dp_shard: int) -> bool:
    return dp_shard > 1 and (not config.ddp or _explicit_sharding(config))


@dataclass(frozen=True)
class DataParallelLayout:
    """How the data-parallel ranks hold a model: decided once per ``mp.init()`` from the
    checked configuration and the topology, kept in the ``ParallelContext``; every
    applier reads it and none works it out again (docs/architecture.md)."""

    size: int  # ranks holding the same model part (rdp: dp_replicate x dp_shard)
    shard_size: int  # dp_shard: ranks one parameter is sharded over (1 = replicated)
    replicas: int  # dp_replicate: copies of each shard
    # hybrid_shard_degree >= 2 or sharded_data_parallel_degree > 1: sharding asked for
    # by degree, which ddp=True and mp.replicate() may not override
    explicit_sharding: bool
    # hybrid_shard_degree != 0 or sharded_data_parallel_degree > 1: the configuration
    # says how to shard at all (0: an FSDP1 script's own strategy stands, as in SMP v2)
    sets_shard_layout: bool
    # what DistributedModel holds each stage in: FSDP2 over dp_shard, or REPLICAS that
    # all-reduce whole gradients (dp_shard 1, or ddp=True without explicit sharding).
    # The other calls name their wrapper: mp.shard FSDP2, mp.replicate DDP, a script's
    # FullyShardedDataParallel FSDP1 (each over this record's shard size and replicas).
    model_wrapper: Wrapper

    @classmethod
    def decide(cls, config: Config, topology: Topology) -> DataParallelLayout:
        return cls(size=topology.dp_replicate * topology.dp_shard,
                   shard_size=topology.dp_shard, replicas=topology.dp_replicate,
                   explicit_sharding=_explicit_sharding(config),
                   sets_shard_layout=config.shard_degree != 0,
                   model_wrapper=Wrapper.FSDP2 if _pipeline_shards(config, topology.dp_shard)
                   else Wrapper.REPLICAS)

    @staticmethod
    def averaging(tp_replicas: bool) -> CommGroup:
        """The group a parameter's gradient is averaged over, whatever the wrapper: the
        reduced data-parallel ranks (same stage, same tensor-parallel shard), or all
        data-parallel ranks when the tensor-parallel ranks hold the model whole and are
        replicas too (each trains it on its own batch, as in SMP v1)."""
        return CommGroup.DP_GROUP if tp_replicas else CommGroup.RDP_GROUP
