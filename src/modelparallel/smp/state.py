"""The one process-wide State that ``init()`` fills and ``reset()`` clears.

Only the SMP facade reads it: ``init()`` builds a
:class:`~modelparallel.context.ParallelContext` and every core applier is handed that
context as an argument.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from modelparallel.config import Config, ConfigError
from modelparallel.context import ParallelContext
from modelparallel.parallel.offload import loading_horizon
from modelparallel.smp import torch_clip_hook
from modelparallel.smp.errors import NotInitializedError
from modelparallel.smp.process_groups import build_context
from modelparallel.smp.v2 import fsdp1_hook
from modelparallel.smp.v2.replication_groups import Ranker
from modelparallel.smp.v2.rng_tracker import DEFAULT_NAME, RNGStateTracker
from modelparallel.topology import CommGroup, Topology, fits

logger = logging.getLogger("modelparallel")

# Degrees a script may set on tsm.state before init() (SMP v2's shared scripts set them
# to 1 when they do not use SMP's implementation); init() applies them to the config.
SETTABLE_DEGREES = ("tensor_parallel_degree", "context_parallel_degree",
                    "expert_parallel_degree")


class State:
    """What ``init()`` set up (``mp.state``): the context, and its parts by name (the
    config, the topology, the mesh, the 1-D meshes per dim and SMP group, the device),
    and the names SMP v2 scripts read from ``tsm.state`` (docs/smp-compatibility.md):
    degrees, ranks and process groups by SMP v2's names, the ``ranker`` of replication
    groups, and the activation offloading settings. Without context or expert
    parallelism their rank is 0 and their group holds this rank alone."""

    def __init__(self) -> None:
        self._context: ParallelContext | None = None
        self.generation = 0  # counts init() calls
        self.objects: dict[str, Any] = {}  # made under this init (smp.registry)
        self._degree_overrides: dict[str, int] = {}  # set on tsm.state before init
        self._singletons: dict[str, Any] = {}  # made on first use under this init

    @property
    def initialized(self) -> bool:
        return self._context is not None

    @property
    def context(self) -> ParallelContext:
        """The :class:`ParallelContext` of the current ``init()``."""
        if self._context is None:
            raise NotInitializedError("the parallel context")
        return self._context

    def context_or_none(self) -> ParallelContext | None:
        return self._context

    def require(self, what: str = "this") -> State:
        if self._context is None:
            raise NotInitializedError(what)
        return self

    def set(self, context: ParallelContext | None) -> None:
        self._context = context
        self.objects = {}
        self._singletons = {}
        if context is not None:
            self.generation = context.generation

    # the context's parts, as mp.state has always named them (None before init)
    @property
    def config(self) -> Config | None:
        return self._context.config if self._context else None

    @property
    def topology(self) -> Topology | None:
        return self._context.topology if self._context else None

    @property
    def mesh(self) -> Any:
        return self._context.mesh if self._context else None

    @property
    def meshes(self) -> dict[str, Any]:
        return dict(self._context.meshes) if self._context else {}

    @property
    def device(self) -> torch.device:
        return self._context.device if self._context else torch.device("cpu")

    @property
    def rank(self) -> int:
        return self._context.rank if self._context else 0

    @property
    def local_rank(self) -> int:
        return self._context.local_rank if self._context else 0

    @property
    def local_size(self) -> int:
        return self._context.local_size if self._context else 1

    @property
    def group_labels(self) -> dict[str, str]:
        return dict(self._context.group_labels or {}) if self._context else {}

    @property
    def collective_timeout(self) -> datetime.timedelta:
        """The configured ``collective_timeout``, for process groups made after init."""
        return self.context.collective_timeout

    def process_group(self, group: CommGroup) -> dist.ProcessGroup:
        """The torch ProcessGroup of this rank for an SMP group."""
        return self.require(f"{group.name}").context.process_group(group)


    # -- SMP v2's names (tsm.state) -------------------------------------------------
    def _ctx(self, name: str) -> ParallelContext:
        if self._context is None:
            raise NotInitializedError(f"tsm.state.{name}")
        return self._context

    # sizes and degrees
    @property
    def world_size(self) -> int:
        return self._ctx("world_size").topology.world_size

    @property
    def hybrid_shard_degree(self) -> int:
        """The number of ranks each parameter is sharded over (SMP v2's degree after it
        resolved 0 to the full data-parallel width)."""
        return self._ctx("hybrid_shard_degree").topology.dp_shard

    @property
    def tensor_parallel_degree(self) -> int:
        if self._context is None:
            return self._degree_overrides.get("tensor_parallel_degree", 1)
        return self._context.topology.tp

    @tensor_parallel_degree.setter
    def tensor_parallel_degree(self, value: int) -> None:
        self._override("tensor_parallel_degree", value)

    @property
    def context_parallel_degree(self) -> int:
        if self._context is None:
            return self._degree_overrides.get("context_parallel_degree", 1)
        return self._context.config.context_parallel_degree

    @context_parallel_degree.setter
    def context_parallel_degree(self, value: int) -> None:
        self._override("context_parallel_degree", value)

    @property
    def expert_parallel_degree(self) -> int:
        if self._context is None:
            return self._degree_overrides.get("expert_parallel_degree", 1)
        return self._context.config.expert_parallel_degree

    @expert_parallel_degree.setter
    def expert_parallel_degree(self, value: int) -> None:
        self._override("expert_parallel_degree", value)

    def _override(self, key: str, value: int) -> None:
        if self._context is not None:
            raise RuntimeError(f"tsm.state.{key} cannot change after tsm.init(); set "
                               f"{key} in the configuration, or on tsm.state before init")
        self._degree_overrides[key] = int(value)

    def take_degree_overrides(self) -> dict[str, int]:
        """The degrees set on the state before init (init applies them, once)."""
        overrides, self._degree_overrides = self._degree_overrides, {}
        return overrides

    @property
    def tp_size(self) -> int:
        return self.tensor_parallel_degree

    @property
    def tp_rank(self) -> int:
        return self._ctx("tp_rank").coordinate("tp")

    @property
    def cp_size(self) -> int:
        return self.context_parallel_degree

    @property
    def cp_rank(self) -> int:
        """This rank's index in its context-parallel group (which chunks it holds)."""
        return self._ctx("cp_rank").topology.cp_rank(dist.get_rank())

    @property
    def ep_size(self) -> int:
        return self.expert_parallel_degree

    @property
    def ep_rank(self) -> int:
        """This rank's index in its expert-parallel group (which experts it holds)."""
        return self._ctx("ep_rank").topology.ep_rank(dist.get_rank())

    @property
    def dp_rank(self) -> int:
        return self._ctx("dp_rank").topology.rank_in(dist.get_rank(), CommGroup.RDP_GROUP)

    @property
    def dp_size(self) -> int:
        return self._ctx("dp_size").topology.size_of(CommGroup.RDP_GROUP)

    # process groups
    @property
    def world_process_group(self) -> dist.ProcessGroup:
        self._ctx("world_process_group")
        world = dist.group.WORLD
        assert world is not None
        return world

    @property
    def tp_process_group(self) -> dist.ProcessGroup:
        return self._ctx("tp_process_group").process_group(CommGroup.TP_GROUP)

    @property
    def dp_process_group(self) -> dist.ProcessGroup:
        return self._ctx("dp_process_group").process_group(CommGroup.RDP_GROUP)

    @property
    def rep_rank_process_group(self) -> dist.ProcessGroup:
        """The ranks of this rank's replica that shard the model together (SMP v2: the
        devices with the same replication rank)."""
        return self._ctx("rep_rank_process_group").meshes["dp_shard"].get_group()

    @property
    def cp_process_group(self) -> dist.ProcessGroup:
        """The ranks that split this rank's sequences (this rank alone when
        ``context_parallel_degree`` is 1: made on first use by every rank together)."""
        group = self._ctx("cp_process_group").cp_group
        return group if group is not None else self._singleton("cp_process_group")

    @property
    def ep_process_group(self) -> dist.ProcessGroup:
        """The ranks that split this rank's experts (this rank alone when
        ``expert_parallel_degree`` is 1, made like cp's)."""
        group = self._ctx("ep_process_group").ep_group
        return group if group is not None else self._singleton("ep_process_group")

    def _singleton(self, name: str) -> dist.ProcessGroup:
        self._ctx(name)
        if "group" not in self._singletons:
            # one group per rank, made collectively (new_subgroups is called by all ranks)
            group, _ = dist.new_subgroups(group_size=1)
            self._singletons["group"] = group
        return self._singletons["group"]

    def reset(self) -> None:
        """``tsm.state.reset()``: forget the initialization (as ``tsm.reset()``)."""
        self.set(None)

    @property
    def ranker(self) -> Ranker:
        return Ranker(self._ctx("ranker"))

    # activation offloading (SMP v2 names; docs/smp-compatibility.md)
    @property
    def sm_activation_offloading(self) -> bool:
        return self._ctx("sm_activation_offloading").config.sm_activation_offloading

    @property
    def activation_loading_horizon(self) -> int:
        """The configured horizon, or SMP v2's default (2) when none is set."""
        config = self._ctx("activation_loading_horizon").config
        return loading_horizon(config.activation_loading_horizon, v2=True)

    @property
    def cfg(self) -> Config:
        """SMP v1's name for the configuration (``smp.state.cfg.fp16``)."""
        return self._ctx("cfg").config

    def get_rng_state_tracker(self) -> RNGStateTracker:
        """The tracker of named random states that SMP v2 passes to activation
        checkpointing, with ``model-parallel-rng`` seeded by ``random_seed`` plus the
        tensor-parallel rank (made on first use after each init)."""
        context = self._ctx("get_rng_state_tracker")
        if "rng" not in self._singletons:
            tracker = RNGStateTracker()
            tracker.add(DEFAULT_NAME, context.config.random_seed + context.coordinate("tp"))
            self._singletons["rng"] = tracker
        return self._singletons["rng"]


state = State()


def init(config: Config | dict | str | os.PathLike | None = None,
         *, timeout: datetime.timedelta | None = None) -> State:
    """Initialize modelparallel: read and check the config, then build the mesh.

    ``config`` is a dict, a path to a JSON or YAML file, a :class:`Config` or ``None``
    (defaults). The launcher's ``MP_CONFIG`` overrides it. Every check runs on every
    rank before any collective, so a bad config fails everywhere with the same
    :class:`~modelparallel.config.ConfigError`. Creates the default process group
    (gloo on CPU, nccl on CUDA) when the launcher has not.

    Every process group gets ``timeout`` (default: the config's ``collective_timeout``
    seconds). A default group that already exists keeps its own timeout, and the
    sub-groups follow it, unless ``timeout`` is given or ``collective_timeout`` is set
    to a value other than its default.
    """
    if state.initialized:
        raise RuntimeError("mp.init() was already called in this process; call mp.reset() "
                           "first to initialize again")
    cfg = _with_overrides(Config.load(config), state.take_degree_overrides())
    world_size = dist.get_world_size() if dist.is_initialized() else \
        int(os.environ.get("WORLD_SIZE", "1"))
    try:
        topology = Topology.from_config(cfg, world_size)  # validates against the world size
    except ConfigError as error:
        raise _with_launch_hint(error, cfg, world_size) from None

    state.set(build_context(cfg, topology, world_size, timeout, state.generation + 1))
    fsdp1_hook.install(state)  # unchanged FSDP1 scripts follow hybrid_shard_degree
    torch_clip_hook.install(state)  # torch's clip_grad_norm_ adds up any layout's norms
    if state.rank == 0:
        logger.info("modelparallel initialized: %s", topology.describe())
    return state


def _with_overrides(cfg: Config, overrides: dict[str, int]) -> Config:
    """``cfg`` with the degrees the script set on ``tsm.state`` before init (they win
    over the configuration and the launcher's, as the script asked for them last)."""
    changed = {k: v for k, v in overrides.items() if getattr(cfg, k) != v}
    if not changed:
        return cfg
    if os.environ.get("RANK", "0") == "0":
        logger.warning("tsm.state set before init overrides the configuration: %s",
                       ", ".join(f"{k}: {getattr(cfg, k)!r} -> {v!r}"
                                 for k, v in changed.items()))
    return cfg.with_changes(**changed)


def reset() -> None:
    """Forget the current initialization (for tests and notebooks).

    Process groups stay alive: a later ``init()`` with the same layout reuses them
    (DTensor caches keep references to meshes, so destroying and re-creating an
    identical mesh would leave those references pointing at dead groups).
    """
    state.set(None)


def is_initialized() -> bool:
    """Whether ``init()`` ran (SMP v1 and v2: ``smp.is_initialized()``)."""
    return state.initialized


def _with_launch_hint(error: ConfigError, cfg: Config, world_size: int) -> ConfigError:
    """A script that needs several processes, started alone with plain ``python``: say
    how to launch it."""
    if world_size != 1 or "RANK" in os.environ:
        return error
    needed = next((n for n in range(2, 4097) if fits(cfg, n)), None)
    if needed is None:
        return error
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "train.py"
    return ConfigError([*error.problems, (
        "launch", f"this is one process started without a launcher; the configuration "
                  f"needs {needed} (or a multiple): run `modelparallel run "
                  f"--nproc-per-node {needed} {script}`")])


