"""Cut a model into pipeline stages between its units (``trace.find_units``).

The model's own ``forward`` runs on every stage, with the first stage's microbatch
inputs, so whatever it computes from them (masks, positions, rotary tables) is there
on every stage. What a stage does not hold is swapped for a stub while it runs: a
module that computes only the shapes of its outputs on the meta device and returns
NaN-filled tensors of those shapes. The stub's parameters, buffers, submodules and
attributes are those of the module it stands for, its tensors replaced by stand-ins
that answer their metadata and refuse their values (``absent.py``). A stage other than
the first takes the arguments it receives (those of its first unit's call computed
from earlier units: tensors anywhere in its positional and keyword arguments, see
``crossing.py``); a stage other than the last sends those of the next stage's first
unit. The modules keep their
classes and names, so tensor-parallel plans, FSDP and state dicts work unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import nn

from modelparallel.parallel.pipeline.absent import Holder, stand_in


@dataclass
class Split:
    """Which stage runs which units, and what crosses each cut."""

    layers: list[str]               # all units, in call order
    starts: list[int]               # first unit index of each stage
    crossing: dict[str, list[int]] = field(default_factory=dict)  # unit -> arg leaves sent
    unused: list[str] = field(default_factory=list)  # units never called: held by stage 0

    @property
    def stages(self) -> int:
        return len(self.starts)

    def layer_range(self, stage: int) -> range:
        end = self.starts[stage + 1] if stage + 1 < self.stages else len(self.layers)
        return range(self.starts[stage], end)

    def modules_of(self, stage: int) -> list[str]:
        """Names of the units stage ``stage`` holds."""
        held = [self.layers[i] for i in self.layer_range(stage)]
        return held + list(self.unused) if stage == 0 else held


class Stub(nn.Module):
    """Stands in for a module another stage holds: outputs of the right shapes, NaN.

    ``path`` is the module's name in the model, ``holder`` the stage that holds it and
    ``device`` this rank's: its tensors' stand-ins report them.
    """

    def __init__(self, original: nn.Module, on_call: Callable[[tuple, dict], None] | None,
                 dtype: torch.dtype | None, *, path: str, holder: Holder,
                 device: torch.device):
        super().__init__()
        # a parameterless meta copy computes output shapes without the weights, its
        # floating parameters in the compute dtype (half precision casts them so)
        def meta(p: torch.Tensor) -> torch.Tensor:
            cast = dtype if dtype is not None and p.is_floating_point() else p.dtype
            return torch.empty_like(p, device="meta", dtype=cast)

        memo: dict[int, torch.Tensor] = {id(p): nn.Parameter(meta(p), p.requires_grad)
                                         for p in original.parameters()}
        memo |= {id(b): torch.empty_like(b, device="meta") for b in original.buffers()}
        self.__dict__["_meta"] = _without_hooks(copy.deepcopy(original, memo))
        self.__dict__["_on_call"] = on_call
        self.__dict__["_cache"] = {}
        # what the model reads of the module: its structure, with stand-in tensors (the
        # model's parameters() inside the forward lists them: HF's model.dtype reads one)
        absent: dict[int, torch.Tensor] = {
            id(b): stand_in(b, f"{path}.{name}", holder, device, None)
            for name, b in original.named_buffers()}
        absent |= {id(p): stand_in(p, f"{path}.{name}", holder, device, dtype)
                   for name, p in original.named_parameters()}
        mirror = _without_hooks(copy.deepcopy(original, absent))
        self.__dict__["_mirror"] = mirror
        for registry in ("_parameters", "_buffers", "_modules"):
            self.__dict__[registry] = getattr(mirror, registry)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # the module's own attributes (its sizes, its methods)
            return getattr(self.__dict__["_mirror"], name)

    def forward(self, *args, **kwargs):
        if self._on_call is not None:
            self._on_call(args, kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key = tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else _hashable(t)
                    for t in leaves)
        device = next((t.device for t in leaves if isinstance(t, torch.Tensor)), None)
        out = self._cache.get(key) if None not in key else None
        if out is None:
            meta_args, meta_kwargs = pytree.tree_unflatten(
                [t.to("meta") if isinstance(t, torch.Tensor) else t for t in leaves], spec)
            with torch.no_grad():
                out = self._meta(*meta_args, **meta_kwargs)
            if None not in key:
                self._cache[key] = out
        return pytree.tree_map(lambda t: _nan_like(t, device) if isinstance(t, torch.Tensor)
                               else t, out)


def _hashable(value):
    if value is None or isinstance(value, bool | int | float | str):
        return ("v", value)
    return None  # unhashable argument: do not cache


def _nan_like(t: torch.Tensor, device) -> torch.Tensor:
    if t.is_floating_point():
        return torch.full(t.shape, float("nan"), dtype=t.dtype, device=device)
    return torch.zeros(t.shape, dtype=t.dtype, device=device)


def _without_hooks(module: nn.Module) -> nn.Module:
    for m in module.modules():
        m._forward_hooks.clear()
        m._forward_pre_hooks.clear()
        m._backward_hooks.clear()
    return module


def swap_module(model: nn.Module, path: str, replacement: nn.Module) -> nn.Module:
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    original = parent._modules[name]
    assert original is not None, f"{path} is not a module"
    parent._modules[name] = replacement
    return original
