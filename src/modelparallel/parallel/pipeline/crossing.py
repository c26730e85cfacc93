"""Where a model may be cut into pipeline stages, and what crosses each cut.

Every stage runs the model's own ``forward``; the units (modules with parameters) held
by other stages are stand-ins returning NaN tensors of the right shapes. A stage that
starts at unit ``c`` receives from the previous stage the arguments of ``c``'s first
call that were computed from earlier units' outputs, and the model's inputs (so that
whatever the model computes from them exists on every stage). The cut before ``c`` is
valid when nothing else computed from an earlier unit's output is used from ``c``'s
call on: such a value would be NaN on the new stage.

:class:`CutAnalysis` follows one forward (a torch function mode, as
``parallel/dataflow.py``): it labels every tensor computed, outside the units, from a
unit's output with the moment it was made (moment ``i + 1`` = after unit ``i``'s first
call), records the last moment each is read, and which labelled tensors each unit is
called with. From that: which cuts are valid, why the others are not, and which
argument leaves cross each valid one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.overrides import TorchFunctionMode

# Ops that only look at a tensor's metadata, which the stand-ins get right: not a read.
_METADATA = {"__get__", "size", "dim", "numel", "__len__", "is_floating_point", "is_complex",
             "stride", "is_contiguous", "element_size", "data_ptr", "get_device", "nelement",
             "ndimension", "storage_offset", "is_signed"}
# Ops making a new tensor from another's metadata alone (``absent.py`` answers them too)
_FROM_METADATA = {"new_empty", "new_zeros", "new_ones", "new_full", "empty_like",
                  "zeros_like", "ones_like", "full_like"}


@dataclass
class Cuts:
    """The result of one analysed forward, indexed like ``order`` (units in call order)."""

    order: list[str]
    valid: list[bool]                            # valid[c]: a stage may start at unit c
    why_not: dict[int, str] = field(default_factory=dict)  # c -> why the cut is invalid
    crossing: dict[str, list[int]] = field(default_factory=dict)  # unit -> arg leaf indices
    nested: list[str] = field(default_factory=list)  # units called inside another unit


class CutAnalysis(TorchFunctionMode):
    """Follows one forward of ``model`` whose ``units`` (module paths) are the pieces a
    stage holds. Use as ``with CutAnalysis(model, units) as a: model(...)``, then
    ``a.result(output)``."""

    def __init__(self, model: nn.Module, units: list[str]):
        super().__init__()
        self._modules = {path: model.get_submodule(path) for path in units}
        self._owner: dict[int, set[str]] = {}
        for path, module in self._modules.items():
            for p in module.parameters():
                self._owner.setdefault(id(p), set()).add(path)
        self.order: list[str] = []
        self._index: dict[str, int] = {}
        self._moment = 0
        self._active: str | None = None
        # id -> (tensor, moment made, the unit whose output or parameters it comes from)
        self._born: dict[int, tuple[torch.Tensor, int, str]] = {}
        self._last_read: dict[int, int] = {}
        self._arg_ids: dict[str, set[int]] = {}
        self.crossing: dict[str, list[int]] = {}
        self._spans: list[tuple[int, int, str]] = []  # cuts lo..hi invalid, and why
        self._param_reads: list[tuple[frozenset[str], int, str]] = []
        self._nested: set[str] = set()
        self._handles: list[Any] = []

    def __enter__(self) -> CutAnalysis:
        for path, module in self._modules.items():
            self._handles += [
                module.register_forward_pre_hook(
                    lambda m, a, k, path=path: self._call(path, a, k), with_kwargs=True),
                module.register_forward_hook(
                    lambda m, a, out, path=path: self._return(path, out), always_call=True)]
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- the hooks -------------------------------------------------------------------
    def _call(self, path: str, args: tuple, kwargs: dict) -> None:
        if self._active is not None:  # a unit inside another: it cannot be held apart
            self._nested.add(path)
            return
        leaves = pytree.tree_leaves((args, kwargs))
        if path not in self._index:  # its first call: the moment a stage could start
            self._index[path] = len(self.order)
            self.order.append(path)
            self._moment = len(self.order)
            seen: set[int] = set()
            self.crossing[path] = []
            for i, t in enumerate(leaves):  # each labelled tensor once, at its first leaf
                if id(t) in self._born and id(t) not in seen:
                    seen.add(id(t))
                    self.crossing[path].append(i)
            self._arg_ids[path] = seen
        else:  # called again later: the stage holding it runs everything in between
            first = self._index[path]
            self._spans.append((first + 1, self._moment - 1,
                                f"'{path}' is called again after '{self.order[-1]}'"))
        for t in leaves:
            self._read(t)
        self._active = path

    def _return(self, path: str, out: Any) -> None:
        if self._active != path:
            return  # a nested unit's return
        self._active = None
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._born[id(t)] = (t, self._moment, f"the output of '{path}'")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat = pytree.tree_leaves((args, kwargs))
        labelled = [t for t in flat if isinstance(t, torch.Tensor) and id(t) in self._born]
        params = [t for t in flat if isinstance(t, torch.Tensor) and id(t) in self._owner]
        if not labelled and not params:
            return out
        if _metadata_only(func, out):
            return out
        for t in labelled:
            self._read(t)
        for p in params:
            self._param_read(p)
        if self._active is None:  # computed from a unit's output or weights, outside units
            source = self._born[id(labelled[0])][2] if labelled else \
                f"the parameters of '{min(self._owner[id(params[0])])}'"
            made = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            name = getattr(func, "__name__", "")
            in_place = name.endswith("_") and not name.endswith("__")
            if args and isinstance(args[0], torch.Tensor) and (in_place or name == "__setitem__"):
                made.append(args[0])
            if isinstance(kwargs.get("out"), torch.Tensor):
                made.append(kwargs["out"])
            for t in made:
                self._born[id(t)] = (t, self._moment, source)
        return out

    def _read(self, t: object) -> None:
        if isinstance(t, torch.Tensor) and id(t) in self._born:
            self._last_read[id(t)] = max(self._last_read.get(id(t), -1), self._moment)

    def _param_read(self, p: torch.Tensor) -> None:
        owners = self._owner[id(p)]
        if self._active in owners:
            return
        where = f"'{self._active}'" if self._active else "the model's own forward"
        # the unit whose stage runs this moment must hold the parameter too
        self._param_reads.append((frozenset(owners), max(self._moment - 1, 0), where))

    # -- the result ------------------------------------------------------------------
    def result(self, output: Any) -> Cuts:
        """Valid cuts, given the model's ``output`` (read at the end)."""
        end = len(self.order) + 1
        for t in pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and id(t) in self._born:
                self._last_read[id(t)] = end
        n = len(self.order)
        for owners, here, where in self._param_reads:
            known = [self._index[o] for o in owners if o in self._index]
            if known:  # (a unit never called is held by the first stage)
                i = min(known, key=lambda k: abs(k - here))
                self._spans.append((min(i, here) + 1, max(i, here),
                                    f"{where} uses the parameters of '{self.order[i]}'"))
        why: dict[int, str] = {}
        for lo, hi, reason in self._spans:
            for c in range(max(lo, 1), min(hi, n - 1) + 1):
                why.setdefault(c, reason)
        for key, (_, made, source) in self._born.items():
            last = self._last_read.get(key, -1)
            for c in range(max(made, 1), min(last - 1, n - 1) + 1):
                if c in why or key in self._arg_ids.get(self.order[c], ()):
                    continue
                reader = "in the model's output" if last == end else \
                    f"at or after '{self.order[last - 1]}'"
                why[c] = (f"a value computed from {source} is used {reader} "
                          f"without being an argument of '{self.order[c]}'")
        valid = [c == 0 or c not in why for c in range(n)]
        return Cuts(list(self.order), valid, why, dict(self.crossing), sorted(self._nested))


def _metadata_only(func: Any, out: Any) -> bool:
    if getattr(func, "__name__", "") in _FROM_METADATA:
        return True
    if getattr(func, "__name__", "") not in _METADATA:
        return False
    return not any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(out))
