"""SMP v1's delayed parameter initialization: record how parameters are initialised,
allocate them later where they are held.

Inside :func:`record`, every parameter a module registers is put on the meta device
(no memory) and the in-place initialisations applied to it are recorded instead of run
on data: ``nn.init.*`` functions, in-place tensor methods (``normal_``, ``fill_``,
``zero_``, ...), also through ``.data``, ``.detach()`` and views (an embedding's
padding row). Buffers are created for real (they are small, and their values often
come from computations that cannot be replayed). :func:`materialize` later allocates a
parameter on a device and replays its recipe. Each replayed operation draws from its
own random stream, seeded from the seed in force when recording began (every rank of
a data-parallel group must build its model with the same seed, as SMP v1 scripts do —
the first rank's values are broadcast afterwards anyway), the parameter's creation
index and the operation's index: values do not depend on which rank materialises
which parameter, nor in what order. A parameter created from real data (a
``nn.Parameter(torch.ones(n))``) keeps that data until an initialisation overwrites it
whole.

SMP v1 records the same way (without torchdistx) and replays after partitioning; its
replay draws from the global random stream in whatever order the partition allocates.
What cannot be recorded (an initialisation that reads another parameter's not yet
allocated value) is refused when the model is built, naming the operation.
"""

from __future__ import annotations

import contextlib
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# on the tensor itself, not in a side table: a recipe travels with its parameter where
# the tensor's __dict__ does (deepcopy, pickling of a delayed model)
RECIPE_ATTR = "_mp_recipe"
_ALIASES = ("data", "detach")  # the same tensor whole under another name


@dataclass
class Recipe:
    """How to rebuild one parameter: its creation data (if any) and the in-place
    operations applied to it, each as (view chain, function, args, kwargs)."""

    seed: int
    index: int  # creation order within the recording
    source: torch.Tensor | None = None
    ops: list[tuple[list, Callable, tuple, dict]] = field(default_factory=list)


@dataclass
class _Tracked:
    root: nn.Parameter
    chain: list  # (function, args, kwargs) deriving this tensor from the root
    whole: bool  # the root itself or an alias of all of it


_local = threading.local()


def recipe_of(t: torch.Tensor) -> Recipe | None:
    """The recorded recipe of a delayed parameter, or None."""
    return getattr(t, RECIPE_ATTR, None)


class _Recorder(TorchFunctionMode):
    def __init__(self, seed: int):
        super().__init__()
        self.seed = seed
        self.count = 0
        self.tracked: dict[int, _Tracked] = {}
        self.keep: list[torch.Tensor] = []  # tracked tensors stay alive: ids stay unique

    def track(self, t: torch.Tensor, info: _Tracked) -> None:
        self.tracked[id(t)] = info
        self.keep.append(t)

    def new_parameter(self, param: nn.Parameter) -> nn.Parameter:
        meta = nn.Parameter(torch.empty_like(param, device="meta"),
                            requires_grad=param.requires_grad)
        recipe = Recipe(self.seed, self.count, source=param.detach())
        self.count += 1
        setattr(meta, RECIPE_ATTR, recipe)
        self.track(meta, _Tracked(meta, [], True))
        return meta

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        info = self.tracked.get(id(target)) if isinstance(target, torch.Tensor) else None
        if info is None:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "__set__" and func == torch.Tensor.data.__set__:  # param.data = t
            recipe = recipe_of(info.root)
            assert recipe is not None
            if not info.whole or not isinstance(args[1], torch.Tensor) or args[1].is_meta:
                _refuse(func)
            recipe.source, recipe.ops = args[1].detach(), []
            return None
        in_place = (getattr(func, "__module__", "") == "torch.nn.init"
                    or name == "__setitem__" or (name.endswith("_") and not name.startswith("_")))
        if in_place:
            self.record(info, func, args, kwargs)
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out is not target and not in_place:
            alias = name in _ALIASES or (name == "__get__" and func == torch.Tensor.data.__get__)
            view = out._base is not None and id(out._base) in self.tracked
            if alias or view:
                rest = args[1:] if args else ()
                self.track(out, _Tracked(info.root, [*info.chain, (func, rest, kwargs)],
                                         info.whole and alias))
        return out

    def record(self, info: _Tracked, func: Callable, args: tuple, kwargs: dict) -> None:
        others = [*args[1:], *(v for k, v in kwargs.items() if k != "tensor")]
        if any(isinstance(v, torch.Tensor) and v.is_meta for v in others):
            _refuse(func)
        recipe = recipe_of(info.root)
        assert recipe is not None
        rest = args[1:] if args else ()
        kw = {k: v for k, v in kwargs.items() if k != "tensor"}
        if info.whole and name_overwrites(func):
            recipe.source, recipe.ops = None, []  # what came before no longer matters
        recipe.ops.append((info.chain, func, rest, kw))


def name_overwrites(func: Callable) -> bool:
    """Whether ``func`` applied to a whole tensor sets every element without reading it."""
    name = getattr(func, "__name__", "")
    if getattr(func, "__module__", "") == "torch.nn.init":
        return name not in ("dirac_",)  # dirac_ zeroes first too, but keep it simple
    return name in ("normal_", "uniform_", "fill_", "zero_", "copy_", "random_", "exponential_",
                    "geometric_", "log_normal_", "cauchy_", "bernoulli_")


def _refuse(func: Callable) -> None:
    raise RuntimeError(
        f"delayed parameter initialization cannot record {getattr(func, '__qualname__', func)}"
        ": it reads the value of a parameter that is not allocated yet; build this model "
        "outside smp.delay_param_initialization() (or smp.model_creation with "
        "delayed_parameter_initialization False)")


@contextlib.contextmanager
def record(enabled: bool = True, seed: int | None = None) -> Iterator[None]:
    """Parameters registered inside are created on the meta device with a recipe
    (see the module's docstring); ``seed`` defaults to ``torch.initial_seed()``."""
    if not enabled or getattr(_local, "recorder", None) is not None:
        yield  # nested: the outer recording goes on
        return
    recorder = _Recorder(torch.initial_seed() if seed is None else seed)
    original = nn.Module.register_parameter

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta and id(param) not in recorder.tracked:
            param = recorder.new_parameter(param)
        original(self, name, param)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    _local.recorder = recorder
    try:
        with recorder:
            yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
        _local.recorder = None


def _stream_seed(recipe: Recipe, op: int) -> int:
    return zlib.crc32(f"{recipe.seed}/{recipe.index}/{op}".encode())


def materialize(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new tensor on ``device`` holding what the recipe of ``param`` builds."""
    recipe = recipe_of(param)
    if recipe is None:
        raise ValueError("not a parameter recorded by delay_param_initialization")
    if recipe.source is not None:
        value = recipe.source.to(device=device, dtype=param.dtype, copy=True)
    else:
        value = torch.empty(param.shape, dtype=param.dtype, device=device)
    devices = [device] if device.type == "cuda" else []
    with torch.no_grad():
        for k, (chain, func, args, kwargs) in enumerate(recipe.ops):
            target = value
            for derive, derive_args, derive_kwargs in chain:
                target = derive(target, *derive_args, **derive_kwargs)
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(_stream_seed(recipe, k))
                func(target, *args, **kwargs)
    return value


def stand_ins(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """While inside, every recorded parameter still on the meta device is replaced by a
    zero-filled view of one element expanded to its shape (no memory), so the model can
    run a forward pass (the pipeline split times one); the meta ones come back after."""
    return _StandIns(model)


class _StandIns(contextlib.AbstractContextManager):
    def __init__(self, model: nn.Module):
        self.model = model
        self.swapped: list[tuple[nn.Module, str, nn.Parameter]] = []

    def __enter__(self) -> None:
        made: dict[int, nn.Parameter] = {}
        for module in self.model.modules():
            for name, p in list(module._parameters.items()):
                if p is None or not p.is_meta or recipe_of(p) is None:
                    continue
                if id(p) not in made:
                    zero = torch.zeros((), dtype=p.dtype).expand(p.shape)
                    made[id(p)] = nn.Parameter(zero, requires_grad=False)
                self.swapped.append((module, name, p))
                module._parameters[name] = made[id(p)]

    def __exit__(self, *exc: Any) -> None:
        for module, name, p in reversed(self.swapped):
            module._parameters[name] = p
        self.swapped.clear()
