"""SMP v1's module replacement for tensor parallelism: ``smp.tp_register_with_module(cls,
dist_module, init_hook, forward_hook, return_hook)`` and ``@smp.tp_register``.

A module marked for tensor parallelism (created inside ``smp.tensor_parallelism()`` /
``smp.model_creation(tensor_parallelism=True)``, or ``smp.set_tensor_parallelism``)
whose class has a replacement is swapped for ``dist_module`` when
``smp.DistributedModel`` wraps the model, as SMP does; the outermost such module wins.
``init_hook`` turns the original's constructor arguments into ``dist_module``'s,
``forward_hook`` the caller's forward arguments into its, and ``return_hook`` its
output into what the caller expects (torch forward hooks on the new module).
``smp.tensor_parallelism(**options)`` override ``dist_module``'s arguments.

Built in, as in SMP: Hugging Face's ``GPT2LMHeadModel`` becomes
``smp.nn.DistributedTransformerLMHead``. Where a state-dict translator is known
(GPT-2), the new module takes the original's weights, so a pretrained model stays
pretrained; otherwise (and when the original's parameters were never allocated, under
delayed initialization) it keeps its own initialisation, as SMP's modules do. The
replacement is split by its own tensor-parallel plan (``smp/nn/plans.py``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modelparallel.module_state import lookup, state_of
from modelparallel.parallel import deferred
from modelparallel.parallel.tensor import plans
from modelparallel.smp.state import state

logger = logging.getLogger("modelparallel")

StateDict = dict[str, torch.Tensor]
_local = threading.local()


@dataclass(frozen=True)
class Replacement:
    """What replaces a module class, and how its calls are translated."""

    dist_module: type[nn.Module]
    init_hook: Callable[..., tuple[tuple, dict[str, Any]]] | None = None
    forward_hook: Callable[..., tuple[tuple, dict[str, Any]]] | None = None
    return_hook: Callable[[Any], Any] | None = None
    translate: Callable[[StateDict], StateDict] | None = None  # original's weights -> new
    finish: Callable[[nn.Module], None] | None = None  # built-ins: last touches on the new


_REGISTERED: dict[type, Replacement] = {}
# Hugging Face classes by name, so transformers is not imported to register them
_BUILTIN_BY_NAME: dict[str, Callable[[], Replacement]] = {}


def builtin(hf_class_name: str) -> Callable[[Callable[[], Replacement]], Callable[[], Replacement]]:
    """Decorator: the factory gives the built-in replacement of a Hugging Face class."""

    def register(factory: Callable[[], Replacement]) -> Callable[[], Replacement]:
        _BUILTIN_BY_NAME[hf_class_name] = factory
        return factory

    return register


def register(module_cls: type[nn.Module], dist_module: type[nn.Module],
             init_hook: Callable[..., tuple[tuple, dict[str, Any]]] | None = None,
             forward_hook: Callable[..., tuple[tuple, dict[str, Any]]] | None = None,
             return_hook: Callable[[Any], Any] | None = None) -> None:
    """Replace marked ``module_cls`` modules by ``dist_module`` (SMP's registration)."""
    for name, cls in (("module_cls", module_cls), ("dist_module", dist_module)):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"tp_register_with_module: {name} must be an nn.Module subclass, "
                            f"got {cls!r}")
    for name, hook in (("init_hook", init_hook), ("forward_hook", forward_hook),
                       ("return_hook", return_hook)):
        if hook is not None and not callable(hook):
            raise TypeError(f"tp_register_with_module: {name} must be callable, got {hook!r}")
    _REGISTERED[module_cls] = Replacement(dist_module, init_hook, forward_hook, return_hook)
    _record_init_args(module_cls)


def unregister(module_cls: type[nn.Module]) -> None:
    """Forget a replacement registered for ``module_cls``."""
    _REGISTERED.pop(module_cls, None)


def _record_init_args(cls: type[nn.Module]) -> None:
    """Make instances of ``cls`` remember their constructor arguments (for init_hook)."""
    original = cls.__init__
    if getattr(original, "_mp_records_args", False):
        return

    @functools.wraps(original)
    def init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if type(self) is cls:
            state_of(self).init_args = (args, kwargs)

    init._mp_records_args = True  # type: ignore[attr-defined]
    cls.__init__ = init  # type: ignore[method-assign]


@contextlib.contextmanager
def creating_with(options: dict[str, Any]) -> Iterator[None]:
    """Modules created inside remember ``options`` (``smp.tensor_parallelism(**options)``),
    which override the arguments of a module that replaces them."""
    if not options:
        yield
        return
    original = nn.Module.__init__

    def init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        state_of(self).tp_options = dict(options)

    nn.Module.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.__init__ = original  # type: ignore[method-assign]


def replacement_for(module: nn.Module) -> Replacement | None:
    """The registered (or built-in) replacement of this module's class, if any."""
    cls = type(module)
    if cls in _REGISTERED:
        return _REGISTERED[cls]
    if cls.__module__.startswith("transformers.") and cls.__name__ in _BUILTIN_BY_NAME:
        return _BUILTIN_BY_NAME[cls.__name__]()
    return None


def replace_marked(module: nn.Module) -> nn.Module:
    """``module`` with every outermost marked module that has a replacement replaced
    (the module itself if it is one); children are replaced in place."""
    if plans.marked(module) is False:
        return module
    found = replacement_for(module) if plans.marked(module) else None
    if found is not None:
        return _replace(module, found)
    for name, child in list(module.named_children()):
        new = replace_marked(child)
        if new is not child:
            setattr(module, name, new)
    return module


def _init_args(module: nn.Module) -> tuple[tuple, dict[str, Any]]:
    recorded = lookup(module, "init_args")
    if recorded is not None:
        return recorded
    if hasattr(module, "config"):  # Hugging Face models are built from their config
        return (module.config,), {}
    raise RuntimeError(
        f"{type(module).__name__} was created before its replacement was registered, so its "
        "constructor arguments are unknown; call smp.tp_register_with_module before "
        "creating the model")


def _replace(module: nn.Module, found: Replacement) -> nn.Module:
    args, kwargs = _init_args(module)
    if found.init_hook is not None:
        args, kwargs = found.init_hook(*args, **kwargs)
    kwargs = {**kwargs, **lookup(module, "tp_options", {})}  # SMP: the options override
    params = list(module.parameters())
    delayed = any(p.is_meta or deferred.recipe_of(p) is not None for p in params)
    with deferred.record(delayed):
        new = found.dist_module(*args, **kwargs)
    floating = [p.dtype for p in params if p.is_floating_point()]
    if floating:
        new.to(floating[0])
    carried = found.translate is not None and not delayed
    if carried:
        _load(new, found.translate(module.state_dict()), type(module).__name__)  # type: ignore[misc]
    if found.finish is not None:
        found.finish(new)
    plans.set_tensor_parallelism(new, True)
    if (stage := lookup(module, "partition")) is not None:
        state_of(new).partition = stage
    if found.forward_hook is not None:
        hook = found.forward_hook
        new.register_forward_pre_hook(lambda m, a, k: hook(*a, **k), with_kwargs=True)
    if found.return_hook is not None:
        back = found.return_hook
        new.register_forward_hook(lambda m, a, out: back(out))
    if state.rank == 0:
        logger.warning("%s replaced by smp.nn's %s for tensor parallelism (as SMP does); %s",
                       type(module).__name__, found.dist_module.__name__,
                       "its weights carried over" if carried else "with the new module's "
                       "own initialisation")
    return new


def _load(new: nn.Module, state_dict: StateDict, source: str) -> None:
    """Load the translated weights; only buffers may be missing (causal masks)."""
    result = new.load_state_dict(state_dict, strict=False)
    buffers = {name for name, _ in new.named_buffers()}
    missing = [k for k in result.missing_keys if k not in buffers]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"{source}'s weights do not fit {type(new).__name__}: missing "
                           f"{missing}, unexpected {result.unexpected_keys}")


def tp_register(dist_module: type[nn.Module],
                init_hook: Callable[..., tuple[tuple, dict[str, Any]]] | None = None,
                forward_hook: Callable[..., tuple[tuple, dict[str, Any]]] | None = None,
                return_hook: Callable[[Any], Any] | None = None,
                ) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """SMP v1's class decorator: ``@smp.tp_register(DistModule, ...)`` on a module class
    is ``smp.tp_register_with_module(cls, DistModule, ...)``."""

    def decorate(module_cls: type[nn.Module]) -> type[nn.Module]:
        register(module_cls, dist_module, init_hook, forward_hook, return_hook)
        return module_cls

    return decorate


def tp_register_with_module(module_cls: type[nn.Module], plan: Any,
                            init_hook: Callable[..., tuple[tuple, dict[str, Any]]] | None = None,
                            forward_hook: Callable[..., tuple[tuple, dict[str, Any]]] | None = None,
                            return_hook: Callable[[Any], Any] | None = None) -> None:
    """Tell the library how to split ``module_cls``, in either of two forms.

    SMP v1's: ``plan`` is a distributed module class (e.g. ``smp.nn.DistributedTransformer``)
    that replaces marked ``module_cls`` modules, with the optional hooks (this module's
    docstring). modelparallel's: ``plan`` is a tensor-parallel plan (a ``TPPlan``, a
    ``{submodule path: ParallelStyle}`` dict, one ``ParallelStyle``, or a function
    ``(module, TPOptions)`` returning one), which splits the module in place; no hooks.
    """
    if isinstance(plan, type) and not issubclass(plan, nn.Module):
        raise TypeError(f"tp_register_with_module: {plan!r} is neither an nn.Module subclass "
                        "(SMP's form) nor a tensor-parallel plan")
    if isinstance(plan, type):
        plans.unregister(module_cls)
        register(module_cls, plan, init_hook, forward_hook, return_hook)
        return
    if (init_hook, forward_hook, return_hook) != (None, None, None):
        raise TypeError("tp_register_with_module: hooks go with a distributed module class "
                        f"(SMP's form), not with a tensor-parallel plan ({plan!r})")
    unregister(module_cls)
    plans.tp_register_with_module(module_cls, plan)


def unreplaced_with_options(root: nn.Module) -> list[nn.Module]:
    """The outermost modules created with ``smp.tensor_parallelism(**options)`` that no
    replacement took (their options have no effect)."""
    found: list[nn.Module] = []
    prefixes: list[str] = []
    for name, module in root.named_modules():
        if lookup(module, "tp_options") is not None and \
                not any(name.startswith(p) for p in prefixes):
            found.append(module)
            prefixes.append(f"{name}." if name else "")
    return found
