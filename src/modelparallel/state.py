"""The one process-wide State that ``init()`` fills and ``reset()`` clears."""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from modelparallel.config import Config, ConfigError
from modelparallel.topology import GROUP_DIMS, CommGroup, Topology, build_mesh

logger = logging.getLogger("modelparallel")


class NotInitializedError(RuntimeError):
    def __init__(self, what: str = "this"):
        super().__init__(f"modelparallel is not initialized: call mp.init(config) before "
                         f"using {what}")


@dataclass
class State:
    """What ``init()`` set up: the config, the topology, the mesh and the groups."""

    config: Config | None = None
    topology: Topology | None = None
    mesh: Any = None  # torch.distributed.device_mesh.DeviceMesh, the root
    meshes: dict[str, Any] = field(default_factory=dict)  # 1-D mesh per dim and SMP group
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    rank: int = 0
    local_rank: int = 0
    local_size: int = 1
    group_labels: dict[str, str] = field(default_factory=dict)  # pg name -> our label

    @property
    def initialized(self) -> bool:
        return self.config is not None

    @property
    def collective_timeout(self) -> datetime.timedelta:
        """The configured ``collective_timeout``, for process groups made after init."""
        return datetime.timedelta(seconds=self.require("collective_timeout").config
                                  .collective_timeout)

    def require(self, what: str = "this") -> State:
        if not self.initialized:
            raise NotInitializedError(what)
        return self

    def process_group(self, group: CommGroup) -> dist.ProcessGroup:
        """The torch ProcessGroup of this rank for an SMP group."""
        self.require(f"{group.name}")
        if group is CommGroup.WORLD:
            return dist.group.WORLD
        dims = GROUP_DIMS[group]
        return self.meshes[dims[0] if len(dims) == 1 else group.value].get_group()


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
    cfg = Config.load(config)
    world_size = dist.get_world_size() if dist.is_initialized() else \
        int(os.environ.get("WORLD_SIZE", "1"))
    topology = Topology.from_config(cfg, world_size)  # validates against the world size

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
    state.config, state.topology, state.device = cfg, topology, device
    state.mesh, state.meshes = mesh, meshes
    state.rank = dist.get_rank()
    state.local_rank = local_rank
    state.local_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    state.group_labels = _label_groups(meshes)
    from modelparallel.parallel import fsdp1  # FSDP1 scripts follow hybrid_shard_degree

    fsdp1.install()
    from modelparallel.checkpoint import guard  # checkpoint calls counted afresh per init

    guard.new_generation()
    if state.rank == 0:
        logger.info("modelparallel initialized: %s", topology.describe())
    return state


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
        backend = dist.group.WORLD._get_backend(torch.device(device_type))
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
    labels = {dist.group.WORLD.group_name: "world"}
    for name, mesh in meshes.items():  # mesh dims come last: the most specific label wins
        labels[mesh.get_group().group_name] = name
    return labels


def reset() -> None:
    """Forget the current initialization (for tests and notebooks).

    Process groups stay alive: a later ``init()`` with the same layout reuses them
    (DTensor caches keep references to meshes, so destroying and re-creating an
    identical mesh would leave those references pointing at dead groups).
    """
    state.__init__()
