"""The gradient rule of a pipelined model: one place decides what is summed or averaged.

- A parameter several pipeline ranks use (tied across a cut, or the model's own used in
  its forward) gets the sum of their gradients, over a group of exactly those ranks.
- Every other gradient is averaged over the data-parallel replicas (with the
  tensor-parallel ranks when they hold the model whole), unless FSDP already did.
- A parameter a rank did not use joins both with zeros; one that no rank of the group
  used keeps no gradient, as in one process (FSDP's: ``unused_grads``).
- With ``backward_passes_per_step`` > 1 both happen at the last pass of a run only;
  FSDP is told to skip its reduction on the others.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from modelparallel.context import ParallelContext
from modelparallel.topology import CommGroup

# pipeline ranks using a parameter, as held modules of a pipeline rank: rank -> paths
HeldModules = Callable[[int], list[str]]


def shared_parameters(module: nn.Module, ctx: ParallelContext,
                      held_modules: HeldModules) -> list[tuple[dist.ProcessGroup, list[str]]]:
    """Parameters used on more than one pipeline rank, one name per tensor, grouped by the
    pipeline ranks using them, with a process group of those ranks here. The split alone
    decides it, so every rank creates the same groups. Call before freeing other
    stages' parameters."""
    pp = ctx.topology.pp
    ranks_of: dict[int, set[int]] = {}
    for rank in range(pp):
        for path in held_modules(rank):
            for p in module.get_submodule(path).parameters():
                ranks_of.setdefault(id(p), set()).add(rank)
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    for name, p in module.named_parameters():  # tied: first name only
        holders = tuple(sorted(ranks_of.get(id(p), range(pp))))
        if len(holders) > 1:
            by_ranks.setdefault(holders, []).append(name)
    shared = []
    for holders, names in by_ranks.items():
        for ranks in ctx.topology.all_groups(CommGroup.PP_GROUP):  # every rank, same order
            group = dist.new_group([ranks[i] for i in holders], timeout=ctx.collective_timeout)
            if ctx.rank in ranks and ctx.coordinate("pp") in holders:
                shared.append((group, names))
    return shared


class GradientSync:
    """Reduces a pipelined (or plain) model's gradients after the steps that end a run
    of ``backward_passes_per_step`` training steps."""

    def __init__(self, module: nn.Module, ctx: ParallelContext, passes_per_sync: int):
        self.module = module
        self.ctx = ctx
        self.passes_per_sync = passes_per_sync
        self.passes = 0
        self.shared: list[tuple[dist.ProcessGroup, list[str]]] = []
        self.fsdp: set[int] = set()  # ids of the parameters FSDP manages (and averages)
        self.tp_replicas = False  # the TP ranks hold the model whole: data-parallel replicas
        self._shared_before: dict[str, torch.Tensor] = {}  # summed gradients set aside

    def syncs_this_step(self) -> bool:
        """Whether this training step ends a run of ``backward_passes_per_step``."""
        return (self.passes + 1) % self.passes_per_sync == 0

    def before_step(self) -> None:
        """Set gradients that already hold a sum over pipeline ranks aside, so that a step
        that accumulates onto them sums only its own part. FSDP reduces gradients in
        backward: only on the steps that synchronize."""
        if not torch.is_grad_enabled():
            return
        if self.passes % self.passes_per_sync == 0:  # a run of passes starts
            params = dict(self.module.named_parameters(remove_duplicate=False))
            for _, names in self.shared:
                for name in names:
                    grad = params[name].grad
                    if grad is not None:
                        self._shared_before[name] = grad
                        params[name].grad = None
        if self.passes_per_sync > 1:
            sync = self.syncs_this_step()
            for module in self.module.modules():
                if isinstance(module, FSDPModule):
                    module.set_requires_gradient_sync(sync, recurse=False)

    def after_step(self, held: list[nn.Parameter]) -> None:
        """Training: synchronize the gradients of ``held`` (every
        ``backward_passes_per_step`` steps). Evaluation: FSDP keeps a root unit's
        parameters gathered after forward, for a backward that never comes; free them."""
        if torch.is_grad_enabled():
            if self.syncs_this_step():
                self._synchronize(held)
            self.passes += 1
            return
        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _synchronize(self, held: list[nn.Parameter]) -> None:
        params = dict(self.module.named_parameters(remove_duplicate=False))
        for group, names in self.shared:
            all_reduce_grads([params[n] for n in names], group)
        for name, before in self._shared_before.items():  # what earlier steps summed
            grad = params[name].grad
            params[name].grad = before if grad is None else grad + before
        self._shared_before = {}
        group = self.ctx.gradient_group(self.tp_replicas)
        size = dist.get_world_size(group)
        if size > 1:
            all_reduce_grads([p for p in held if id(p) not in self.fsdp], group, 1 / size)


def all_reduce_grads(params: list[nn.Parameter], group: dist.ProcessGroup,
                     scale: float = 1.0) -> None:
    """Sum (times ``scale``) this rank's part of the parameters' gradients over ``group``,
    as one flat tensor. A parameter this rank's step did not use (a branch its batch
    did not take; a model parameter read before the first layer, on a later pipeline
    stage) joins with a zero gradient: every rank must pass the same sizes, and the
    others' gradients are its too. One that no rank of ``group`` used keeps no gradient,
    as in one process (an optimizer skips it: no weight decay, no state): a flag per
    parameter, whether this rank has its gradient, rides in the same all-reduce."""
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    missing = [p.grad is None for p in params]
    for p, absent in zip(params, missing, strict=True):
        if absent:
            p.grad = torch.zeros_like(p)
        elif isinstance(p.grad, DTensor) and isinstance(p, DTensor) and \
                p.grad.placements != p.placements:  # e.g. a vocab-parallel embedding's
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)  # comes back whole
    grads = [g.to_local() if isinstance(g, DTensor) else g
             for g in (p.grad for p in params) if g is not None]
    dtype = functools.reduce(torch.promote_types, [g.dtype for g in grads])
    had = torch.tensor([0.0 if absent else 1.0 for absent in missing], dtype=dtype,
                       device=grads[0].device)
    flat = torch.cat([*(g.reshape(-1) for g in grads), had])
    dist.all_reduce(flat, group=group)
    if scale != 1.0:
        flat *= scale
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    if any(missing):  # reads the flags back (a device sync) only when some are missing
        anywhere = (flat[offset:] > 0).tolist()
        for p, absent, used in zip(params, missing, anywhere, strict=True):
            if absent and not used:
                p.grad = None
