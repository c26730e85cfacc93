"""What a module's forward sees in place of its parameters: a chain of functions.

``add_view(module, fn, names)`` makes the module's forward read ``fn(parameter)``
instead of the parameter for each name: a differentiable cast to half precision, a
gradient all-reduce over the tensor-parallel ranks. The parameter stays the module's
(state dicts, optimizers, FSDP and DDP see it unchanged); during the forward the view
shadows it in the module's ``__dict__`` and is removed afterwards, also when the
forward raises. Several views on one parameter apply in the order they were added
(``first=True`` puts one in front), so they compose: gradients flow back through the
whole chain into the parameter. A view added with ``pinned=True`` stays in front of
all others, also of those added later with ``first=True``: one that changes what the
parameter is (a DTensor's local tensor), so that the other views see what they would
see without it.

Whatever the module holds at that moment is viewed: FSDP's gathered parameter, a DTensor,
or the plain tensor. A parameter used outside its module's own forward (read from a
parent's code) is not viewed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from modelparallel.module_state import own_state, state_of

View = Callable[[torch.Tensor], torch.Tensor]

_MISSING = object()


def add_view(module: nn.Module, view: View, names: Iterable[str], *, first: bool = False,
             pinned: bool = False) -> None:
    """From the next forward on, ``module`` reads ``view(p)`` for each parameter ``p``
    named in ``names`` (``first``: before the views it has; ``pinned``: before every
    view, also those added later)."""
    state = state_of(module)
    if state.param_views is None:  # name -> [view, ...]; how many at the front are pinned
        state.param_views, state.param_views_pinned, state.param_views_saved = {}, {}, []
        module.register_forward_pre_hook(_enter, prepend=False)
        module.register_forward_hook(_leave, always_call=True)
    chains: dict[str, list[View]] = state.param_views
    front: dict[str, int] = state.param_views_pinned  # type: ignore[assignment]
    for name in names:
        chain = chains.setdefault(name, [])
        if pinned or first:
            chain.insert(front.get(name, 0), view)
            if pinned:
                front[name] = front.get(name, 0) + 1
        else:
            chain.append(view)


def has_views(module: nn.Module) -> bool:
    return bool((state := own_state(module)) and state.param_views)


def _enter(module: nn.Module, args) -> None:
    saved = []
    state = state_of(module)
    for name, chain in (state.param_views or {}).items():
        value = getattr(module, name)
        saved.append((name, module.__dict__.get(name, _MISSING)))
        if value is None:
            continue
        for view in chain:
            value = view(value)
        module.__dict__[name] = value
    assert state.param_views_saved is not None  # add_view made it
    state.param_views_saved.append(saved)


def _leave(module: nn.Module, args, output) -> None:
    stack = state.param_views_saved if (state := own_state(module)) else None
    if not stack:
        return
    for name, previous in reversed(stack.pop()):
        if previous is _MISSING:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = previous
