"""Tensor-parallel plans: what to split in a module, and the registry that finds them.

A plan belongs to a module class. ``transform()`` walks a model, asks the registry
for the plan of every module it meets, checks all sizes against the degree, then
applies the plans with DTensor's ``parallelize_module``. Built-in plans cover the
reference models and several Hugging Face architectures (``models/plans.py``);
users add their own with SMP v1's calls, defined here.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import Replicate

from modelparallel.module_state import lookup, state_of

SHARDED, REPLICATED = "sharded", "replicated"


@dataclass(frozen=True)
class TPOptions:
    """What the caller of ``transform()`` asked for."""

    degree: int
    sequence_parallel: bool = False  # norms/dropout work on sequence shards
    loss_parallel: bool = False  # LM head output stays vocabulary-sharded (a DTensor)


@dataclass
class TPPlan:
    """How to split one module.

    ``styles`` maps submodule paths ("" is the module itself) to DTensor parallel
    styles. ``sizes`` names every size the split divides (heads, hidden width,
    vocabulary) so they are checked against the degree before anything is split.
    ``divide_attrs`` are attributes holding a full width the module's own forward
    uses; they become the per-rank width. ``rng`` marks submodules whose random
    numbers (dropout) act on sharded activations (``SHARDED``: each TP rank draws its
    own) or on replicated ones (``REPLICATED``: all TP ranks draw the same).
    ``sequence_parallel`` says whether the plan honours that option.
    """

    styles: dict[str, ParallelStyle]
    sizes: dict[str, int] = field(default_factory=dict)
    divide_attrs: tuple[str, ...] = ()
    rng: dict[str, str] = field(default_factory=dict)
    sequence_parallel: bool = False


PlanLike = TPPlan | Mapping[str, ParallelStyle] | ParallelStyle
# (module, options) -> plan; modules are typed loosely: Hugging Face classes are named,
# not imported, and their attributes are read by name
PlanFactory = Callable[[Any, TPOptions], PlanLike]


def as_plan(plan: PlanLike) -> TPPlan:
    """A ``TPPlan`` from a plan, a ``{path: style}`` dict or one style for the module."""
    if isinstance(plan, TPPlan):
        return plan
    if isinstance(plan, ParallelStyle):
        return TPPlan(styles={"": plan})
    if isinstance(plan, Mapping):
        return TPPlan(styles=dict(plan))
    raise TypeError(f"a tensor-parallel plan must be a TPPlan, a dict of ParallelStyle or a "
                    f"ParallelStyle, not {type(plan).__name__}")


_BUILTIN_BY_CLASS: dict[type, PlanFactory] = {}
_BUILTIN_BY_NAME: dict[str, PlanFactory] = {}  # Hugging Face classes, without importing them
_REGISTERED: dict[type, PlanFactory] = {}
_context = threading.local()


def builtin(*keys: type | str) -> Callable[[PlanFactory], PlanFactory]:
    """Decorator: the factory is the built-in plan for these classes (or HF class names)."""

    def register(factory: PlanFactory) -> PlanFactory:
        for key in keys:
            if isinstance(key, str):
                _BUILTIN_BY_NAME[key] = factory
            else:
                _BUILTIN_BY_CLASS[key] = factory
        return factory

    return register


def tp_register_with_module(module_cls: type[nn.Module],
                            plan: PlanLike | PlanFactory) -> None:
    """Tell the library how to split ``module_cls`` (SMP v1's registration call).

    ``plan`` is a ``TPPlan``, a ``{submodule path: ParallelStyle}`` dict, one
    ``ParallelStyle`` for the module itself, or a function ``(module, TPOptions)``
    returning one of these. A registration overrides a built-in plan.
    """
    if not (isinstance(module_cls, type) and issubclass(module_cls, nn.Module)):
        raise TypeError(f"tp_register_with_module needs an nn.Module subclass, got {module_cls!r}")
    if callable(plan) and not isinstance(plan, (ParallelStyle, Mapping, TPPlan)):
        _REGISTERED[module_cls] = plan
    else:
        fixed = as_plan(plan)
        _REGISTERED[module_cls] = lambda module, options: fixed


def unregister(module_cls: type[nn.Module]) -> None:
    """Forget a registration made with ``tp_register_with_module``."""
    _REGISTERED.pop(module_cls, None)


def set_tensor_parallelism(module: nn.Module, enabled: bool = True) -> None:
    """Mark ``module`` (and what it contains) as split (``True``) or kept whole (``False``).

    A module marked ``False`` and all its submodules are never split, whatever plan
    they have. ``True`` asks for a split of a module that has no plan of its own:
    ``nn.Linear`` becomes a column-parallel linear with a gathered output and
    ``nn.Embedding`` a vocabulary-parallel embedding.
    """
    state_of(module).tensor_parallel = bool(enabled)


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True) -> Iterator[None]:
    """Modules created inside this block are marked as with ``set_tensor_parallelism``."""
    previous = getattr(_context, "enabled", None)
    _context.enabled = enabled
    original_init = nn.Module.__init__

    def marking_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if getattr(_context, "enabled", None) is not None:
            state_of(self).tensor_parallel = _context.enabled

    nn.Module.__init__ = marking_init  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.__init__ = original_init  # type: ignore[method-assign]
        _context.enabled = previous


def marked(module: nn.Module) -> bool | None:
    """``True``/``False`` if the user marked the module, ``None`` if not."""
    return lookup(module, "tensor_parallel")


def _standalone_plan(module: nn.Module, options: TPOptions) -> TPPlan | None:
    """The split of a lone module the user marked for tensor parallelism."""
    if isinstance(module, nn.Linear):
        return TPPlan(styles={"": ColwiseParallel(output_layouts=Replicate())},
                      sizes={"output features": module.out_features})
    if isinstance(module, nn.Embedding):
        return TPPlan(styles={"": RowwiseParallel(input_layouts=Replicate())},
                      sizes={"vocabulary": module.num_embeddings})
    return None


def plan_for(module: nn.Module, options: TPOptions) -> TPPlan | None:
    """The plan for this module: a registration, a built-in plan, or a marked leaf."""
    cls = type(module)
    factory = _REGISTERED.get(cls) or _BUILTIN_BY_CLASS.get(cls)
    if factory is None and cls.__module__.startswith("transformers."):
        factory = _BUILTIN_BY_NAME.get(cls.__name__)
    if factory is not None:
        return as_plan(factory(module, options))
    if marked(module):
        return _standalone_plan(module, options)
    return None


def builtin_names() -> list[str]:
    """Names of the classes with a built-in plan (for docs and messages)."""
    return sorted({c.__name__ for c in _BUILTIN_BY_CLASS} | set(_BUILTIN_BY_NAME))
