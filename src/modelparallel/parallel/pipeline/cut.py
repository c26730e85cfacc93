"""Cut a model into pipeline stages at the boundaries of its repeated layers.

The model's own ``forward`` runs on every stage, with the real microbatch inputs,
so whatever it computes between layers from its inputs (masks, positions, rotary
tables) is there on every stage and nothing but the hidden state crosses a cut.
What a stage does not hold is swapped for a stub while it runs: a module that
computes only the shapes of its outputs on the meta device and returns NaN-filled
tensors of those shapes. A stage other than the first takes the hidden state it
receives as the first argument of its first layer; a stage other than the last
returns the first argument of the next stage's first layer. The modules keep their
classes and names, so tensor-parallel plans, FSDP and state dicts work unchanged.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import nn

from modelparallel.config import ConfigError
from modelparallel.parallel.blocks import find_blocks


@dataclass
class Trace:
    """What one microbatch through the whole model showed."""

    layers: list[str]                  # layer names in call order
    compute: list[float]               # forward seconds per layer
    memory: list[float]                # parameter + output bytes per layer
    before: dict[str, tuple[float, float]] = field(default_factory=dict)  # module -> cost
    after: dict[str, tuple[float, float]] = field(default_factory=dict)
    shared: list[str] = field(default_factory=list)  # used before and after the layers


def param_modules(model: nn.Module, layer_names: set[str]) -> list[str]:
    """The outermost modules with parameters that neither hold nor sit inside a layer."""
    found = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if path in layer_names:
                continue
            if any(n.startswith(path + ".") for n in layer_names):
                visit(path + ".", child)
            elif any(True for _ in child.parameters()):
                found.append(path)

    visit("", model)
    return found


def trace(model: nn.Module, args: tuple, kwargs: dict) -> Trace:
    """Run one microbatch (no grad) and time every layer and outer module."""
    layers = find_blocks(model)
    if not layers:
        raise ConfigError([("pipeline_parallel_degree", f"{type(model).__name__} has no "
                            "repeated layers (blocks in an nn.ModuleList / nn.Sequential) to "
                            "split into pipeline stages")])
    names = {id(m): n for n, m in model.named_modules()}
    layer_names = {names[id(m)] for m in layers}
    outer = param_modules(model, layer_names)
    calls: dict[str, list[tuple[float, float, float]]] = {}
    starts: dict[str, float] = {}
    handles = []

    def pre(path):
        def hook(module, args):
            starts[path] = time.perf_counter()
        return hook

    def post(path):
        def hook(module, args, out):
            bytes_out = sum(t.numel() * t.element_size() for t in pytree.tree_leaves(out)
                            if isinstance(t, torch.Tensor))
            calls.setdefault(path, []).append((starts[path], time.perf_counter(), bytes_out))
        return hook

    for path in [*layer_names, *outer]:
        module = model.get_submodule(path)
        handles += [module.register_forward_pre_hook(pre(path)),
                    module.register_forward_hook(post(path))]
    try:
        with torch.no_grad():
            model(*args, **kwargs)  # warm-up: first calls pay one-time costs
            calls.clear()
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()

    called = [p for p in layer_names if p in calls]
    order = sorted(called, key=lambda p: calls[p][0][0])
    first_start = calls[order[0]][0][0] if order else 0.0
    last_end = calls[order[-1]][-1][1] if order else 0.0
    result = Trace(order, [], [])
    for path in order:
        t0, t1, out_bytes = calls[path][0]
        result.compute.append(t1 - t0)
        result.memory.append(_param_bytes(model.get_submodule(path)) + out_bytes)
    for path in outer:
        cost = (sum(t1 - t0 for t0, t1, _ in calls.get(path, [])),
                float(_param_bytes(model.get_submodule(path))))
        spans = calls.get(path, [])
        before = not spans or any(t0 < first_start for t0, _, _ in spans)
        after = any(t0 >= last_end for t0, _, _ in spans)
        if before:
            result.before[path] = cost
        if after:
            result.after[path] = cost
        if before and after:
            result.shared.append(path)
    return result


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@dataclass
class Split:
    """Which stage runs which layers and outer modules."""

    layers: list[str]               # all layers, in call order
    starts: list[int]               # first layer index of each stage
    before: list[str]               # outer modules run before the layers (stage 0)
    after: list[str]                # outer modules run after the layers (last stage)

    @property
    def stages(self) -> int:
        return len(self.starts)

    def layer_range(self, stage: int) -> range:
        end = self.starts[stage + 1] if stage + 1 < self.stages else len(self.layers)
        return range(self.starts[stage], end)

    def modules_of(self, stage: int) -> list[str]:
        """Names of the layers and outer modules that stage ``stage`` holds."""
        held = [self.layers[i] for i in self.layer_range(stage)]
        if stage == 0:
            held += self.before
        if stage == self.stages - 1:
            held += [m for m in self.after if m not in held]
        return held


class Stub(nn.Module):
    """Stands in for a module another stage holds: outputs of the right shapes, NaN."""

    def __init__(self, original: nn.Module, on_call: Callable[[tuple, dict], None] | None,
                 dtype: torch.dtype | None = None):
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
