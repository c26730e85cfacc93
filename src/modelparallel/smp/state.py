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
from modelparallel.precision_policy import PrecisionPolicy
from modelparallel.smp import fsdp1_hook
from modelparallel.smp.errors import NotInitializedError
from modelparallel.smp.v2_state import V2Attributes
from modelparallel.topology import CommGroup, DataParallelLayout, Topology, build_mesh, fits

logger = logging.getLogger("modelparallel")


class State(V2Attributes):
    """What ``init()`` set up (``mp.state``): the context, and its parts by name (the
    config, the topology, the mesh, the 1-D meshes per dim and SMP group, the device),
    and SMP v2's names for them (:class:`~modelparallel.smp.v2_state.V2Attributes`)."""

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

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _device(cfg, local_rank)
    use_cuda = device.type == "cuda"
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if timeout is None:
            timeout = datetime.timedelta(seconds=cfg.collective_timeout)
        _init_default_group(cfg, use_cuda, timeout)

    mesh, meshes = _mesh_for(topology, device.type)
    timeout, default_too = _group_timeout(cfg, timeout, device.type)
    _set_timeouts(timeout, mesh, meshes, default_too)
    state.set(ParallelContext(
        config=cfg, topology=topology,
        data_parallel=DataParallelLayout.decide(cfg, topology),
        precision=PrecisionPolicy.decide(cfg), mesh=mesh, meshes=meshes,
        device=device,
        rank=dist.get_rank(), local_rank=local_rank,
        local_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))),
        group_labels=_label_groups(meshes), generation=state.generation + 1))
    fsdp1_hook.install(state)  # unchanged FSDP1 scripts follow hybrid_shard_degree
    if state.rank == 0:
        logger.info("modelparallel initialized: %s", topology.describe())
        if cfg.offload_activations:  # no effect on models outside DistributedModel
            logger.warning("offload_activations (SMP v1) offloads the checkpointed modules of "
                        "mp.DistributedModel; an FSDP or mp.shard model offloads with "
                        "sm_activation_offloading and torch's offload_wrapper (SMP v2)")
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


def _device(cfg: Config, local_rank: int) -> torch.device:
    """This rank's GPU, or the CPU; a ConfigError when the backend cannot work here."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.ddp_dist_backend == "nccl" and not gpus:
        raise ConfigError([("ddp_dist_backend", "'nccl' needs CUDA GPUs and none is visible; "
                                                "use 'auto' or 'gloo'")])
    if not gpus or cfg.ddp_dist_backend == "gloo":
        return torch.device("cpu")
    if local_rank >= gpus:
        raise ConfigError([("nproc_per_node", f"LOCAL_RANK {local_rank} has no GPU: only {gpus} "
                                              f"are visible; launch at most {gpus} processes "
                                              f"per node")])
    return torch.device("cuda", local_rank)


_MESHES: dict[tuple, tuple[Any, dict[str, Any]]] = {}


def _mesh_for(topology: Topology, device_type: str):
    """The mesh of ``topology``, built once per default process group."""
    key = (topology, device_type, dist.group.WORLD)
    if key not in _MESHES:
        _MESHES[key] = build_mesh(topology, device_type)
    return _MESHES[key]


def _init_default_group(cfg: Config, use_cuda: bool, timeout: datetime.timedelta) -> None:
    backend = cfg.ddp_dist_backend
    if backend == "auto":
        backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
    if "RANK" not in os.environ:  # a plain `python script.py`: one process, no launcher
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(**kwargs)


def _group_timeout(cfg: Config, timeout: datetime.timedelta | None,
                   device_type: str) -> tuple[datetime.timedelta, bool]:
    """The timeout of the groups of this init, and whether the default group gets it too.

    ``timeout`` or a ``collective_timeout`` other than the default wins; otherwise a
    default group made by the user or a test harness keeps its timeout, and the mesh
    groups follow it.
    """
    if timeout is not None:
        return timeout, True
    configured = datetime.timedelta(seconds=cfg.collective_timeout)
    if cfg.collective_timeout != Config.__dataclass_fields__["collective_timeout"].default:
        return configured, True
    try:  # torch has no public getter; Backend.options._timeout is what new_group reads
        backend = _world()._get_backend(torch.device(device_type))
        return backend.options._timeout, False
    except (RuntimeError, AttributeError):  # a backend that does not say
        return configured, False


def _set_timeouts(timeout: datetime.timedelta, mesh: Any, meshes: dict[str, Any],
                  default_too: bool) -> None:
    """Give every mesh group (and the default group if ``default_too``) ``timeout``.

    DeviceMesh makes its sub-groups with torch's backend default (30 minutes for gloo,
    10 for nccl), not the default group's timeout, so they are set here; the cached
    mesh of an earlier init() gets this init's value too. ``ProcessGroup.set_timeout``
    (gloo and nccl) applies to the collectives started after it.
    """
    groups = [*mesh.get_all_groups(), *(m.get_group() for m in meshes.values())]
    if default_too:
        groups.append(dist.group.WORLD)
    for group in {id(g): g for g in groups}.values():
        try:
            group.set_timeout(timeout)
        except RuntimeError as e:  # a backend without timeouts (e.g. a custom one)
            logger.warning("cannot set the timeout of process group %s: %s",
                           group.group_name, e)


def _label_groups(meshes: dict[str, Any]) -> dict[str, str]:
    """Name every process group we made, for communication accounting."""
    labels: dict[str, str] = {_world().group_name: "world"}
    for name, mesh in meshes.items():  # mesh dims come last: the most specific label wins
        labels[mesh.get_group().group_name] = name
    return labels


def _world() -> dist.ProcessGroup:
    world = dist.group.WORLD
    assert world is not None, "the default process group exists after init"
    return world


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


