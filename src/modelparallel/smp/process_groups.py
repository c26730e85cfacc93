"""The process groups and device of an ``init()``: this rank's device, the default process
group when the launcher made none, the mesh (built once per default group) with its
groups' timeouts, and the labels of the groups for communication accounting."""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from modelparallel.config import Config, ConfigError
from modelparallel.context import ParallelContext
from modelparallel.precision_policy import PrecisionPolicy
from modelparallel.topology import DataParallelLayout, Topology, build_mesh

logger = logging.getLogger("modelparallel")


def build_context(cfg: Config, topology: Topology, world_size: int,
                  timeout: datetime.timedelta | None, generation: int) -> ParallelContext:
    """The ParallelContext of a checked configuration: sets this rank's device, creates
    the default process group when the launcher has not, builds the mesh and gives its
    groups ``timeout`` (see ``init``)."""
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
    return ParallelContext(
        config=cfg, topology=topology,
        data_parallel=DataParallelLayout.decide(cfg, topology),
        precision=PrecisionPolicy.decide(cfg), mesh=mesh, meshes=meshes,
        device=device,
        rank=dist.get_rank(), local_rank=local_rank,
        local_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))),
        group_labels=_label_groups(meshes), generation=generation)


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
    groups = [*mesh.get_all_groups(), *(g for m in meshes.values() for g in m.get_all_groups())]
    if default_too:
        groups.append(dist.group.WORLD)
    for group in {id(g): g for g in groups}.values():
        try:
            group.set_timeout(timeout)
        except RuntimeError as e:  # a backend without timeouts (e.g. a custom one)
            logger.warning("cannot set the timeout of process group %s: %s",
                           group.group_name, e)


# the layout's own dims: a group that is also an expert-parallel one keeps its dim's name
# in its label ("dp_shard+ep_index": FSDP's traffic and the experts' travel in one group)
_LAYOUT_DIMS = ("dp_replicate", "dp_shard", "tp", "pp", "cp")


def _label_groups(meshes: dict[str, Any]) -> dict[str, str]:
    """Name every process group we made, for communication accounting."""
    labels: dict[str, str] = {_world().group_name: "world"}
    for name, mesh in meshes.items():  # mesh dims come last: the most specific label wins
        if mesh.ndim == 1:
            pairs = [(name, mesh.get_group())]
        else:  # the experts' meshes: each dim by its name
            pairs = list(zip(mesh.mesh_dim_names, mesh.get_all_groups(), strict=True))
        for label, group in pairs:
            held = labels.get(group.group_name, "").split("+")[0]
            joined = held in _LAYOUT_DIMS and label not in _LAYOUT_DIMS
            labels[group.group_name] = f"{held}+{label}" if joined else label
    return labels


def _world() -> dist.ProcessGroup:
    world = dist.group.WORLD
    assert world is not None, "the default process group exists after init"
    return world
