"""Follow where tensors flow: which values a computation derives from marked ones.

A :class:`DataFlow` is a torch function mode. Inside it, every torch operation whose
inputs include a marked tensor marks its outputs (and the tensor it writes in place),
so after a forward the marks say what was computed from the marked sources — by
identity and data flow, not by value. Two users:

- tensor parallelism marks the local (split) outputs of column-parallel layers and
  finds the replicated tensors that meet split activations (their gradients are
  partial sums, see ``tensor/regions.py``);
- the pipeline marks what stand-ins for other stages' modules return, and checks that
  nothing a stage sends on was computed from them (``pipeline/stage.py``).

It runs for one forward at a time; marked tensors are kept alive until it is dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

# Called for an op that reads a marked tensor: gets the op and its flattened arguments,
# returns them (possibly with some tensors replaced) to run the op on.
MixedHandler = Callable[[Any, list[Any]], list[Any]]


def _plain(t: object) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, DTensor)


class DataFlow(TorchFunctionMode):
    """Marks the outputs of every op that reads a marked tensor (DTensors are ignored:
    they carry their own layout)."""

    def __init__(self, on_marked_input: MixedHandler | None = None):
        super().__init__()
        self._marked: dict[int, torch.Tensor] = {}  # id -> tensor, kept alive: ids stay unique
        self._on_marked_input = on_marked_input

    def mark(self, tree: Any) -> None:
        for t in pytree.tree_leaves(tree):
            if _plain(t):
                self._marked[id(t)] = t

    def unmark(self, tree: Any) -> None:
        for t in pytree.tree_leaves(tree):
            if _plain(t):
                self._marked.pop(id(t), None)

    def is_marked(self, t: object) -> bool:
        return _plain(t) and id(t) in self._marked

    def any_marked(self, tree: Any) -> bool:
        return any(self.is_marked(t) for t in pytree.tree_leaves(tree))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = pytree.tree_flatten((args, kwargs))
        if not any(self.is_marked(t) for t in flat):
            return func(*args, **kwargs)
        if self._on_marked_input is not None:
            flat = self._on_marked_input(func, flat)
            args, kwargs = pytree.tree_unflatten(flat, spec)
        out = func(*args, **kwargs)
        self.mark(out)
        name = getattr(func, "__name__", "")
        in_place = name.endswith("_") and not name.endswith("__")
        if args and (in_place or name == "__setitem__"):  # written in place
            self.mark(args[0])
        if "out" in kwargs:
            self.mark(kwargs["out"])
        return out
