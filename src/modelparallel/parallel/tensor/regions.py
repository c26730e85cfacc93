"""Gradients of replicated tensors that meet split activations are summed over TP ranks.

Between a column-parallel layer and the row-parallel layer after it, each tensor-
parallel rank holds part of the same activation (its attention heads, its MLP units).
A replicated tensor used there — a norm applied to each head (Qwen3's ``q_norm`` /
``k_norm``), a scale, a bias added to the heads — gets from each rank only the gradient
of that rank's part; the full gradient is their sum. DTensor sums the gradients of the
layers a plan splits; this module does the same for everything else a split region
reads, whatever the model: no per-model list.

How: the first training forward runs inside a :class:`~modelparallel.parallel.dataflow.DataFlow`
that marks the local outputs of split layers (and clears the outputs of layers that
gather them again). Every op that reads a marked tensor and a replicated tensor that
needs a gradient has that tensor wrapped in "identity forward, all-reduce the gradient
backward" (Megatron's *f*). A wrapped tensor that is one of the model's parameters (as
its module reads it) gets that wrapping from then on as a parameter view, and the data
flow is no longer followed. A replicated tensor that is not a parameter cannot be
wrapped statically: that model is refused with an error naming the module and the op.

Data flow is followed until every split layer this rank holds has run once in a
training forward (a pipeline rank may run some of its stages later).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)

from modelparallel.config import ConfigError
from modelparallel.module_state import own_state, state_of
from modelparallel.parallel.dataflow import DataFlow
from modelparallel.parallel.param_views import add_view
from modelparallel.parallel.placement import is_meta


def splits_local_output(style: ParallelStyle) -> bool | None:
    """Whether a styled module returns a plain tensor holding only this rank's part of
    the activation (True), the whole activation (False), or None: a style we do not
    know, whose output keeps the marks the data flow gives it."""
    layouts: tuple[Placement, ...] | Placement | None
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        layouts, local = style.output_layouts, style.use_local_output
    elif isinstance(style, PrepareModuleOutput):
        layouts, local = style.desired_output_layouts, style.use_local_output
    elif isinstance(style, SequenceParallel):
        return bool(style.use_local_output)
    else:
        return None
    first = layouts[0] if isinstance(layouts, tuple | list) else layouts
    if not local:
        return False  # a DTensor: it carries its own layout
    return isinstance(first, Shard)


def sum_over(mesh: DeviceMesh):
    """Identity forward; backward, the gradient summed over ``mesh`` (Megatron's *f*)."""

    def view(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            return t  # DTensor reduces its own gradients
        return DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(
            grad_placements=[Partial()])

    return view


class SplitRegions:
    """Finds, on the first training forwards, the replicated tensors that split regions
    of ``model`` read, and sums their gradients over ``mesh`` (the TP dimension)."""

    def __init__(self, model: nn.Module, styled: list[tuple[str, nn.Module, ParallelStyle]],
                 mesh: DeviceMesh):
        self.model = model
        self.mesh = mesh
        self._sum = sum_over(mesh)
        self.flow: DataFlow | None = None
        self.running: list[nn.Module] = []  # modules whose forward runs (while following)
        self._handles: list[Any] = []
        self.forwards_left = _MAX_FOLLOWED_FORWARDS
        self.summed: set[tuple[int, str]] = set()  # (id(module), parameter name)
        self.pending = {id(m) for _, m, _ in styled if _holds(m)}
        self._paths = {id(m): path for path, m in model.named_modules()}
        for _, module, style in styled:
            module.register_forward_hook(self._after_styled(splits_local_output(style)),
                                         always_call=True)
        model.register_forward_pre_hook(self._before_forward)
        model.register_forward_hook(self._after_forward, always_call=True)
        state_of(model).split_regions = self

    def summed_names(self) -> list[str]:
        """The parameters whose gradients are summed over the tensor-parallel ranks."""
        return sorted(f"{self._paths[m]}.{name}".lstrip(".") for m, name in self.summed)

    # -- hooks -----------------------------------------------------------------------
    def _after_styled(self, split: bool | None):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.flow is None:
                return
            self.pending.discard(id(module))
            if split:
                self.flow.mark(output)
            elif split is False:
                self.flow.unmark(output)
        return hook

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if (self.pending and self.forwards_left and self.flow is None
                and torch.is_grad_enabled()):
            self.forwards_left -= 1
            self.running = [module]  # its own global post-hook will pop it
            self._handles = [register_module_forward_pre_hook(self._entered),
                             register_module_forward_hook(self._left, always_call=True)]
            self.flow = DataFlow(self._wrap_replicated)
            self.flow.__enter__()

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.flow is None:
            return
        flow, self.flow = self.flow, None
        flow.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles, self.running = [], []

    def _entered(self, module: nn.Module, args: Any) -> None:
        self.running.append(module)

    def _left(self, module: nn.Module, args: Any, output: Any) -> None:
        self.running.pop()  # a hook's return value would replace the output

    def _flow(self) -> DataFlow:
        assert self.flow is not None, "called by the data flow while it runs"
        return self.flow

    # -- an op reads a split activation ------------------------------------------------
    def _wrap_replicated(self, func: Any, flat: list[Any]) -> list[Any]:
        out = []
        for t in flat:
            if (isinstance(t, torch.Tensor) and not isinstance(t, DTensor)
                    and t.requires_grad and not self._flow().is_marked(t)
                    and self._make_static(t, func)):
                t = self._sum(t)
            out.append(t)
        return out

    def _make_static(self, t: torch.Tensor, func: Any) -> bool:
        """From the next forward on, sum the gradient of the parameter ``t`` is (as the
        forward of the module holding it reads it: a view applies there only). Whether
        ``t`` itself still needs summing (not when its view already sums it)."""
        for module in reversed(self.running):
            for name, _ in module.named_parameters(recurse=False):
                if getattr(module, name) is t:
                    if (id(module), name) in self.summed:
                        return False
                    self.summed.add((id(module), name))
                    add_view(module, self._sum, [name], first=True)
                    return True
        op = getattr(func, "__name__", str(func))
        where = (self._paths.get(id(self.running[-1]), "") if self.running else "") or \
            f"the model ({type(self.model).__name__})"
        raise ConfigError([("tensor_parallel_degree", (
            f"in {where}: a replicated tensor that needs a "
            f"gradient (shape {tuple(t.shape)}, not a parameter of a module whose forward is "
            f"running) meets a tensor-parallel split activation in op {op!r}: its gradient "
            "would be a partial sum on each rank. Compute it inside the module that uses it "
            "(from its parameters or inputs), split that module with a plan of its own "
            "(mp.tp_register_with_module), or keep the enclosing module whole "
            "(mp.set_tensor_parallelism(module, False))"))])


def split_regions(model: nn.Module) -> SplitRegions | None:
    """The SplitRegions ``transform`` gave ``model`` (or a module a wrapper holds)."""
    return next((s.split_regions for m in model.modules()
                 if (s := own_state(m)) is not None and s.split_regions is not None), None)


# A pipeline rank may run its stages in different forwards; a held split layer that never
# runs would otherwise keep the data flow on for good.
_MAX_FOLLOWED_FORWARDS = 16


def _holds(module: nn.Module) -> bool:
    """Whether this rank holds ``module`` (a pipeline rank keeps other stages on meta)."""
    params = list(module.parameters())
    return not params or not any(is_meta(p) for p in params)
