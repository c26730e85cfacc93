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

View = Callable[[torch.Tensor], torch.Tensor]

_ATTR = "_mp_param_views"  # name -> [view, ...] on a module that has views
_PINNED = "_mp_param_views_pinned"  # name -> how many views at the front are pinned
_MISSING = object()


def add_view(module: nn.Module, view: View, names: Iterable[str], *, first: bool = False,
             pinned: bool = False) -> None:
    """From the next forward on, ``module`` reads ``view(p)`` for each parameter ``p``
    named in ``names`` (``first``: before the views it has; ``pinned``: before every
    view, also those added later)."""
    chains: dict[str, list[View]] | None = module.__dict__.get(_ATTR)
    if chains is None:
        chains = {}
        object.__setattr__(module, _ATTR, chains)
        object.__setattr__(module, _PINNED, {})
        module.register_forward_pre_hook(_enter, prepend=False)
        module.register_forward_hook(_leave, always_call=True)
    front: dict[str, int] = module.__dict__[_PINNED]
    for name in names:
        chain = chains.setdefault(name, [])
        if pinned or first:
            chain.insert(front.get(name, 0), view)
            if pinned:
                front[name] = front.get(name, 0) + 1
        else:
            chain.append(view)


def has_views(module: nn.Module) -> bool:
    return bool(module.__dict__.get(_ATTR))


def _enter(module: nn.Module, args) -> None:
    saved = []
    for name, chain in module.__dict__[_ATTR].items():
        value = getattr(module, name)
        saved.append((name, module.__dict__.get(name, _MISSING)))
        if value is None:
            continue
        for view in chain:
            value = view(value)
        module.__dict__[name] = value
    module.__dict__.setdefault("_mp_param_views_saved", []).append(saved)


def _leave(module: nn.Module, args, output) -> None:
    stack = module.__dict__.get("_mp_param_views_saved")
    if not stack:
        return
    for name, previous in reversed(stack.pop()):
        if previous is _MISSING:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = previous
