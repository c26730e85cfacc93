"""Materialise a model built on the meta device one FSDP unit at a time.

A model too large for one rank's memory is built with its parameters on the meta
device (``with torch.device("meta")``, ``accelerate.init_empty_weights()``, SMP v1's
``delay_param_initialization``). Sharding then allocates and initialises it unit by
unit: a unit's parameters are allocated whole, initialised by an init function (one
module's own parameters per call, as FSDP1's ``param_init_fn``), made equal to the
first data-parallel rank's (which may hold real weights: fine-tuning), and sharded
before the next unit is allocated. A rank's peak is what it keeps (its shards) plus
about one unit whole.

- :func:`empty_module_params` / :func:`move_buffers_to_device`: SMP v2's helpers.
- :func:`default_init_fn`: replays a parameter's recorded recipe (SMP v1,
  :mod:`modelparallel.parallel.deferred`), else the module's ``reset_parameters()``
  (what FSDP1 does for meta modules without ``param_init_fn``).
- :class:`Materializer`: materialises one unit (used by ``sharding`` and
  ``parallelize``), keeping parameters tied when an init function replaced one of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from modelparallel.context import ParallelContext
from modelparallel.parallel import deferred
from modelparallel.parallel.placement import is_meta, on_mesh_dims
from modelparallel.parallel.replicas import broadcast_from_first
from modelparallel.topology import CommGroup

InitFn = Callable[[nn.Module], None]
_DATA_DIMS = {"dp_shard", "dp_replicate"}


def empty_module_params(module: nn.Module, device: torch.device | str | None = None,
                        recurse: bool = False) -> None:
    """Replace ``module``'s parameters on the meta device by uninitialised ones on
    ``device`` (default: the current CUDA device, else the CPU); children too with
    ``recurse``. Parameters elsewhere and buffers are left as they are."""
    target = default_device(device)
    for m in module.modules() if recurse else [module]:
        for name, p in list(m._parameters.items()):
            if p is not None and is_meta(p) and not isinstance(p, DTensor):
                m._parameters[name] = nn.Parameter(torch.empty_like(p, device=target),
                                                   requires_grad=p.requires_grad)


def move_buffers_to_device(module: nn.Module, device: torch.device | str | None = None,
                           recurse: bool = False) -> None:
    """Move ``module``'s buffers to ``device`` (children's too with ``recurse``). A buffer
    on the meta device has no value to move: that is an error naming it."""
    target = default_device(device)
    for prefix, m in module.named_modules() if recurse else [("", module)]:
        for name, b in list(m._buffers.items()):
            if b is None:
                continue
            if b.is_meta:
                raise RuntimeError(
                    f"buffer {_join(prefix, name)} of {type(m).__name__} is on the meta device, "
                    "so its value is unknown: build the model with real buffers "
                    "(accelerate.init_empty_weights() keeps them, or "
                    "modelparallel.delayed_param.init_empty_weights()), not under "
                    "torch.device('meta')")
            m._buffers[name] = b.to(target)


@contextlib.contextmanager
def init_empty_weights() -> Iterator[None]:
    """Parameters registered inside are created on the meta device; buffers stay real
    (as ``accelerate.init_empty_weights()``), so their values survive."""
    original = nn.Module.register_parameter

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(torch.empty_like(param, device="meta"),
                                 requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def default_init_fn(device: torch.device) -> InitFn:
    """Recorded recipes (SMP v1), else ``reset_parameters()``; see the module docstring."""

    def init(module: nn.Module) -> None:
        own = [(n, p) for n, p in module._parameters.items() if p is not None and is_meta(p)]
        replayable = [(n, p) for n, p in own if deferred.recipe_of(p) is not None]
        for name, p in replayable:
            module._parameters[name] = nn.Parameter(deferred.materialize(p, device),
                                                    requires_grad=p.requires_grad)
        if len(replayable) == len(own):
            move_buffers_to_device(module, device)
            return
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            names = [n for n, p in own if deferred.recipe_of(p) is None]
            raise RuntimeError(
                f"{type(module).__name__} has parameters {names} on the meta device and no "
                "reset_parameters() to initialise them: pass param_init_fn= (for instance "
                "DelayedParamIniter(model).get_param_init_fn())")
        empty_module_params(module, device)
        move_buffers_to_device(module, device)
        with torch.no_grad():
            reset()

    return init


def owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Parameter id -> every (module, name) holding it (tied parameters have several)."""
    found: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                found.setdefault(id(p), []).append((m, name))
    return found


def materialize_module(module: nn.Module, init_fn: InitFn,
                       tied: dict[int, list[tuple[nn.Module, str]]] | None = None, *,
                       recorded_only: bool = False) -> None:
    """Initialise ``module``'s own meta parameters (and meta buffers) with ``init_fn``.

    A tensor-parallel (DTensor) meta parameter is handed to ``init_fn`` whole and keeps
    this rank's part of the result. ``tied``: :func:`owners` of the model; a parameter
    ``init_fn`` replaced is replaced in its other holders too. ``recorded_only``: only
    parameters with a recorded recipe are delayed; other meta parameters stand for what
    other pipeline stages hold and stay."""
    own = {n: p for n, p in module._parameters.items() if p is not None and is_meta(p)
           and (not recorded_only or deferred.recipe_of(p) is not None)}
    meta_buffers = any(b.is_meta for b in module.buffers(recurse=False))
    if not own and (recorded_only or not meta_buffers):
        return
    split = {n: p for n, p in own.items() if isinstance(p, DTensor)}
    for name, p in split.items():  # whole, on meta: what init_fn knows how to fill
        module._parameters[name] = nn.Parameter(
            torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
    init_fn(module)
    for name, p in split.items():
        whole = module._parameters[name]
        if whole is not None and not whole.is_meta:
            part = distribute_tensor(whole.detach(), p.device_mesh, p.placements,
                                     src_data_rank=None)  # this rank's part, no traffic
            module._parameters[name] = nn.Parameter(part, requires_grad=p.requires_grad)
    left = [n for n in own if _still_meta(module._parameters[n])]
    left += [n for n, b in module._buffers.items() if b is not None and b.is_meta]
    if left:
        raise RuntimeError(f"the parameter init function left {left} of "
                           f"{type(module).__name__} on the meta device")
    for name, old in own.items():
        new = module._parameters[name]
        for holder, attr in (tied or {}).get(id(old), []):
            if holder._parameters.get(attr) is old:
                holder._parameters[attr] = new


class Materializer:
    """Allocates, initialises and synchronises one FSDP unit at a time (see the module
    docstring). ``init_fn`` defaults to :func:`default_init_fn` on ``ctx.device``."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, init_fn: InitFn | None = None,
                 *, recorded_only: bool = False):
        self.ctx = ctx
        self.init_fn = init_fn or default_init_fn(ctx.device)
        self.tied = owners(model)
        self.recorded_only = recorded_only

    def allocate(self, unit: nn.Module) -> None:
        """Materialise the meta parameters of ``unit`` (see ``recorded_only``)."""
        for module in unit.modules():
            materialize_module(module, self.init_fn, self.tied,
                               recorded_only=self.recorded_only)

    def __call__(self, unit: nn.Module) -> None:
        """Materialise the meta parameters of ``unit`` that FSDP does not manage yet, then
        give every not yet sharded parameter of it the first data-parallel rank's value."""
        self.allocate(unit)
        for p in _unique(unit.parameters()):
            if not _fsdp_managed(p):
                self._synchronize(p)

    def _synchronize(self, p: torch.Tensor) -> None:
        # one tensor at a time: no second copy of the unit (broadcast_from_first flattens)
        split = isinstance(p, DTensor)
        if split and self.ctx.topology.tp == 1:
            return
        group = self.ctx.process_group(CommGroup.RDP_GROUP if split else CommGroup.DP_GROUP)
        broadcast_from_first([p], group)


def held_anywhere(model: nn.Module, ctx: ParallelContext) -> bool:
    """Whether some data-parallel rank has parameters of ``model`` on the meta device
    (collective over the data-parallel group: ranks may differ when one holds real
    weights, as in fine-tuning)."""
    flag = torch.tensor([float(any(is_meta(p) for p in model.parameters()))])
    group = ctx.process_group(CommGroup.DP_GROUP)
    if dist.get_world_size(group) > 1:
        flag = flag.to(ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def synchronize_buffers(model: nn.Module, ctx: ParallelContext) -> None:
    """Every rank takes the first data-parallel rank's buffers (they must be real)."""
    buffers = list(model.buffers())
    for b in buffers:
        if b.is_meta:
            move_buffers_to_device(model, ctx.device, recurse=True)  # raises, naming it
    broadcast_from_first(_unique(buffers), ctx.process_group(CommGroup.DP_GROUP))


def _still_meta(p: torch.Tensor | None) -> bool:
    return p is not None and is_meta(p)


def _fsdp_managed(p: torch.Tensor) -> bool:
    return on_mesh_dims(p, _DATA_DIMS)


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return list({id(t): t for t in tensors}.values())


def default_device(device: torch.device | str | None = None) -> torch.device:
    """``device``, else the current CUDA device, else the CPU."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
