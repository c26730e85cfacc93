"""The traced microbatch a pipeline split is chosen from: units, costs, valid cuts.

A model is cut between its *units*: the modules with parameters, taken whole when they
are repeated blocks (transformer layers: ``parallel.blocks.find_blocks``) or hold
parameters of their own, and looked into otherwise (containers, a Hugging Face model's
inner ``model``), so that a CNN's convolutions and linear layers are units as much as a
GPT's embeddings, blocks, final norm and head. Modules without parameters (activations,
pooling, dropout, rotary tables) are no units: every stage runs them.

:func:`trace` runs one microbatch: once under :class:`crossing.CutAnalysis` (call order,
which cuts are valid and what crosses them), then timed several times; a unit's compute
cost is the least of its times (on a busy machine a run is often slowed several-fold by
other processes, never sped up), its memory cost its parameter bytes plus output bytes.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import nn

from modelparallel.config import ConfigError
from modelparallel.parallel.blocks import find_blocks
from modelparallel.parallel.pipeline.crossing import CutAnalysis

# Timed forwards: at least 3; then until 5 and a quarter second, or 2 seconds, or 20.
TIMED_RUNS = (3, 5, 20)
TIMED_SECONDS = (0.25, 2.0)


@dataclass
class Trace:
    """What one microbatch through the whole model showed (rank 0's, used by all)."""

    layers: list[str]                  # units in call order
    compute: list[float]               # least forward seconds per unit
    memory: list[float]                # parameter + output bytes per unit
    valid: list[bool]                  # valid[c]: a stage may start at unit c
    why_not: dict[int, str] = field(default_factory=dict)   # c -> why it may not
    crossing: dict[str, list[int]] = field(default_factory=dict)  # unit -> arg leaves sent
    unused: list[str] = field(default_factory=list)  # units never called: on stage 0


def find_units(model: nn.Module, exclude: frozenset[str] = frozenset()) -> list[str]:
    """Paths of ``model``'s units, in module order (see the module docstring): repeated
    blocks, and outside them the outermost modules with parameters of their own or
    without children; other modules are looked into.

    ``exclude``: paths that are not units (called inside another unit); their children
    are not units either: their parameters stay on every stage, like the root's own.
    """
    blocks = {id(b) for b in find_blocks(model)}
    units: list[str] = []
    seen: set[int] = set()

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if id(child) in seen or path in exclude or not _has_parameters(child):
                continue
            seen.add(id(child))
            own = any(True for _ in child.parameters(recurse=False))
            holds_blocks = any(id(m) in blocks for m in child.modules() if m is not child)
            if id(child) in blocks or (not holds_blocks and (own or _is_leaf(child))):
                units.append(path)
            else:  # a container, or a module around blocks (its own parameters stay
                visit(path + ".", child)  # on every stage, like the root's)

    visit("", model)
    return units


_TRACING = contextvars.ContextVar("modelparallel_pipeline_tracing", default=False)


def is_tracing() -> bool:
    """Whether the model's forward is running inside :func:`trace` (SMP's
    ``smp.is_tracing()``: a script may skip work there)."""
    return _TRACING.get()


def trace(model: nn.Module, args: tuple, kwargs: dict) -> Trace:
    """Run one microbatch (no grad): the units, their costs and where to cut."""
    token = _TRACING.set(True)
    try:
        return _trace(model, args, kwargs)
    finally:
        _TRACING.reset(token)


def _trace(model: nn.Module, args: tuple, kwargs: dict) -> Trace:
    excluded: frozenset[str] = frozenset()
    while True:  # a unit called inside another is no unit: look again without it
        units = find_units(model, excluded)
        with torch.no_grad(), CutAnalysis(model, units) as analysis:
            output = model(*args, **kwargs)
        cuts = analysis.result(output)
        if not cuts.nested:
            break
        excluded |= frozenset(cuts.nested)
    del output, analysis
    if not cuts.order:
        raise ConfigError([("pipeline_parallel_degree", (
            f"{type(model).__name__} calls no module with parameters in its forward, so "
            f"there is nothing to split into pipeline stages"))])
    times, out_bytes = _timed(model, args, kwargs, cuts.order)
    memory = [float(_param_bytes(model.get_submodule(p)) + out_bytes[p]) for p in cuts.order]
    return Trace(cuts.order, [times[p] for p in cuts.order], memory, cuts.valid,
                 cuts.why_not, cuts.crossing, [u for u in units if u not in cuts.order])


def _timed(model: nn.Module, args: tuple, kwargs: dict, units: list[str],
           ) -> tuple[dict[str, float], dict[str, int]]:
    """Least seconds per unit over several forwards, and each unit's output bytes."""
    sync = _synchronizer(model)
    runs: list[dict[str, float]] = []
    out_bytes: dict[str, int] = {}
    starts: dict[str, float] = {}
    handles = []

    def pre(path):
        def hook(module, a):
            sync()
            starts[path] = time.perf_counter()
        return hook

    def post(path):
        def hook(module, a, out):
            sync()
            runs[-1][path] = runs[-1].get(path, 0.0) + time.perf_counter() - starts[path]
            if len(runs) == 1:
                out_bytes[path] = out_bytes.get(path, 0) + sum(
                    t.numel() * t.element_size() for t in pytree.tree_leaves(out)
                    if isinstance(t, torch.Tensor))
        return hook

    for path in units:
        module = model.get_submodule(path)
        handles += [module.register_forward_pre_hook(pre(path)),
                    module.register_forward_hook(post(path))]
    try:
        with torch.no_grad():
            began = time.perf_counter()
            while not _enough(len(runs), time.perf_counter() - began):
                runs.append({})
                model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return ({p: min(run.get(p, 0.0) for run in runs) for p in units},
            {p: out_bytes.get(p, 0) for p in units})


def _enough(runs: int, seconds: float) -> bool:
    least, usual, most = TIMED_RUNS
    return runs >= most or (runs >= least and seconds >= TIMED_SECONDS[1]) or \
        (runs >= usual and seconds >= TIMED_SECONDS[0])


def _synchronizer(model: nn.Module):
    """Wait for the device before reading the clock (GPU kernels run asynchronously)."""
    devices = {p.device for p in model.parameters() if p.device.type == "cuda"}
    if devices and torch.cuda.is_available():
        return torch.cuda.synchronize
    return lambda: None


def _is_leaf(module: nn.Module) -> bool:
    return not any(True for _ in module.children())


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())
