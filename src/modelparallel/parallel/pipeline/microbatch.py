"""Splitting a step function's inputs into microbatches and collecting its outputs (SMP v1).

``split_step_inputs`` turns one call of an ``@smp.step`` function into ``microbatches``
calls, each on an equal slice of every tensor argument. ``collect_step_outputs`` gathers
what those calls returned into ``StepOutput`` objects, as SMP v1's ``smp.step`` does.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Collection, Iterator, Mapping, MutableMapping
from typing import Any

import torch

from modelparallel.data import check_microbatches

__all__ = ["StepOutput", "collect_step_outputs", "split_step_inputs"]


# ---------------------------------------------------------------------------- splitting


def split_step_inputs(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    microbatches: int,
    *,
    non_split_inputs: Collection[str] = (),
    input_split_axes: Mapping[str, int] | None = None,
) -> list[tuple[tuple, dict]]:
    """Split the call ``fn(*args, **kwargs)`` into ``microbatches`` calls.

    Every tensor (also inside lists, tuples, namedtuples and dicts) is cut into
    ``microbatches`` equal views along its split axis: 0 unless ``input_split_axes``
    names the parameter. Parameters named in ``non_split_inputs`` are passed whole to
    every microbatch, as are 0-dim tensors and any object that is not a tensor or a
    container. An object with a method ``smp_slice(num_mb, mb_index, axis)`` is replaced
    by its slice for each microbatch.

    Returns one ``(args, kwargs)`` pair per microbatch; positional arguments stay
    positional and keywords stay keywords. Raises ``BatchSizeError`` when a tensor does
    not split evenly, ``ValueError`` for unknown parameter names, and ``TypeError`` when
    the arguments do not fit ``fn``'s signature.
    """
    if microbatches < 1:
        raise ValueError(f"microbatches must be at least 1, got {microbatches}")
    axes = dict(input_split_axes or {})
    sig = inspect.signature(fn)
    name = _fn_name(fn)
    _check_names(sig, name, non_split_inputs, axes)
    sig.bind(*args, **kwargs)  # fail here, like the call itself would, on a bad call
    if microbatches == 1:
        return [(args, kwargs)]

    def split_arg(value: Any, names: tuple[str, ...], path: str) -> list[Any]:
        # ``names`` are the configuration keys that apply to this argument, most specific
        # first: an extra keyword matches its own name and that of the ``**kwargs``.
        if any(n in non_split_inputs for n in names):
            return [value] * microbatches
        axis = next((axes[n] for n in names if n in axes), 0)
        return _split(value, axis, microbatches, path, name)

    positional, var_positional, var_keyword = _param_layout(sig)
    per_arg: list[list[Any]] = []
    for i, value in enumerate(args):
        if i < len(positional):
            pname, path = positional[i], f"'{positional[i]}'"
        else:  # bind() succeeded, so the surplus goes to *args
            assert var_positional is not None  # bind() succeeded
            pname, path = var_positional, f"'{var_positional}'[{i - len(positional)}]"
        per_arg.append(split_arg(value, (pname,), path))
    per_kwarg: dict[str, list[Any]] = {}
    for key, value in kwargs.items():
        names = (key,) if key in sig.parameters or var_keyword is None else (key, var_keyword)
        per_kwarg[key] = split_arg(value, names, f"'{key}'")

    return [
        (tuple(parts[i] for parts in per_arg), {k: parts[i] for k, parts in per_kwarg.items()})
        for i in range(microbatches)
    ]


def _fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", None) or repr(fn)


def _param_layout(sig: inspect.Signature) -> tuple[list[str], str | None, str | None]:
    """Names of the positional parameters, of ``*args`` and of ``**kwargs``."""
    positional, var_positional, var_keyword = [], None, None
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional.append(p.name)
        elif p.kind is p.VAR_POSITIONAL:
            var_positional = p.name
        elif p.kind is p.VAR_KEYWORD:
            var_keyword = p.name
    return positional, var_positional, var_keyword


def _check_names(sig: inspect.Signature, fn_name: str, non_split: Collection[str],
                 axes: Mapping[str, int]) -> None:
    if isinstance(non_split, str):  # a lone name would otherwise be read letter by letter
        raise TypeError(f"non_split_inputs must be a collection of names, got {non_split!r}")
    params = list(sig.parameters)
    # With **kwargs, any name may arrive as an extra keyword, so none can be called unknown.
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    for option, names in (("non_split_inputs", non_split), ("input_split_axes", axes)):
        for n in names:
            if n not in params and not takes_any:
                raise ValueError(f"{option} names {n!r}, which is not a parameter of "
                                 f"{fn_name}; its parameters are {params}")
    for n, axis in axes.items():
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise ValueError(f"input_split_axes[{n!r}] must be an int axis, got {axis!r}")
    both = sorted(set(non_split) & set(axes))
    if both:
        raise ValueError(f"{both} named in both non_split_inputs and input_split_axes; "
                         f"an input is either split along an axis or passed whole")


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _split(obj: Any, axis: int, mb: int, path: str, fn_name: str) -> list[Any]:
    """``obj`` cut into ``mb`` pieces; an unsplit object is the same object ``mb`` times."""
    if not isinstance(obj, type) and callable(getattr(obj, "smp_slice", None)):
        return [obj.smp_slice(mb, i, axis) for i in range(mb)]
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            return [obj] * mb
        if not -obj.dim() <= axis < obj.dim():
            raise ValueError(f"argument {path} of {fn_name} has {obj.dim()} dimensions, "
                             f"so it cannot be split along axis {axis}")
        check_microbatches(obj.size(axis), mb, where=f"argument {path} of {fn_name}")
        return list(obj.tensor_split(mb, dim=axis))  # exactly mb views, even when empty
    if isinstance(obj, (list, tuple)):
        fields: Any = getattr(obj, "_fields", ())  # a namedtuple's field names
        label = (lambda i: f".{fields[i]}") if _is_namedtuple(obj) else (lambda i: f"[{i}]")
        parts = [_split(v, axis, mb, path + label(i), fn_name) for i, v in enumerate(obj)]
        if _untouched(obj, parts):
            return [obj] * mb
        return [_rebuild(obj, [p[i] for p in parts]) for i in range(mb)]
    if isinstance(obj, (dict, MutableMapping)):
        keys = list(obj.keys())
        parts = [_split(obj[k], axis, mb, f"{path}[{k!r}]", fn_name) for k in keys]
        if _untouched(obj.values(), parts):
            return [obj] * mb
        return [_rebuild(obj, dict(zip(keys, [p[i] for p in parts], strict=True)))
                for i in range(mb)]
    return [obj] * mb


def _untouched(children: Any, parts: list[list[Any]]) -> bool:
    # A container with nothing to split is shared, not copied mb times (torch.Size too).
    return all(all(piece is child for piece in p) for child, p in zip(children, parts,
                                                                       strict=True))


def _rebuild(obj: Any, items: Any) -> Any:
    """A container of ``obj``'s type holding ``items`` (a list, or a dict for mappings)."""
    if isinstance(obj, (list, tuple)):
        if _is_namedtuple(obj):
            return type(obj)(*items)
        return type(obj)(items)
    # copy keeps a mapping's own state (defaultdict's factory, a ModelOutput's fields).
    new = copy.copy(obj)
    for k, v in items.items():
        new[k] = v
    return new


# ---------------------------------------------------------------------------- collecting


class StepOutput:
    """One output of a step function, across microbatches (SMP v1's ``StepOutput``).

    ``outputs[i]`` is what microbatch ``i`` returned at this position. Reduce with
    ``reduce_mean``/``reduce_sum``, or join with ``concat``/``stack``.
    """

    def __init__(self, outputs: list[Any]):
        self.outputs = list(outputs)

    def __len__(self) -> int:
        return len(self.outputs)

    def __getitem__(self, i: int) -> Any:
        return self.outputs[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.outputs)

    def __repr__(self) -> str:
        items = ", ".join(_describe(o) for o in self.outputs)
        return f"StepOutput({len(self.outputs)} microbatches: [{items}])"

    def reduce_mean(self) -> torch.Tensor | float:
        """Mean over microbatches: a tensor for tensor outputs, a float for numbers."""
        if self._kind("reduce_mean") == "numbers":
            return sum(self.outputs) / len(self.outputs)
        stacked = torch.stack(self.outputs)
        if not (stacked.is_floating_point() or stacked.is_complex()):
            stacked = stacked.to(torch.get_default_dtype())  # torch refuses mean of ints
        return stacked.mean(0)

    def reduce_sum(self) -> torch.Tensor | int | float:
        """Sum over microbatches: a tensor for tensor outputs, a number for numbers."""
        if self._kind("reduce_sum") == "numbers":
            return sum(self.outputs)
        return torch.stack(self.outputs).sum(0)

    def concat(self) -> torch.Tensor:
        """The microbatches' outputs joined along dim 0 (stacked when they are 0-dim)."""
        if self._kind("concat") == "numbers":
            return torch.tensor(self.outputs)
        if all(o.dim() == 0 for o in self.outputs):
            return torch.stack(self.outputs)
        return torch.cat(self.outputs, dim=0)

    def stack(self) -> torch.Tensor:
        """The microbatches' outputs stacked along a new dim 0."""
        if self._kind("stack") == "numbers":
            return torch.tensor(self.outputs)
        return torch.stack(self.outputs)

    def _kind(self, op: str) -> str:
        if not self.outputs:
            raise ValueError(f"StepOutput.{op}: there are no microbatch outputs")
        if all(isinstance(o, torch.Tensor) for o in self.outputs):
            return "tensors"
        if all(isinstance(o, (int, float)) for o in self.outputs):
            return "numbers"
        kinds = sorted({type(o).__name__ for o in self.outputs})
        raise TypeError(f"StepOutput.{op} needs all tensors or all numbers, but the "
                        f"microbatch outputs are {', '.join(kinds)}: {self!r}")


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            return f"tensor({obj.item()!r})" if obj.device.type != "meta" else "tensor(meta)"
        return f"Tensor{list(obj.shape)} {str(obj.dtype).removeprefix('torch.')}"
    text = repr(obj)
    return text if len(text) <= 40 else text[:37] + "..."


def collect_step_outputs(per_microbatch: list[Any]) -> Any:
    """Gather each microbatch's return value into ``StepOutput`` objects.

    Tuples, lists and dicts (nested too) keep their structure with a ``StepOutput`` at
    every leaf, so ``loss, acc = step(...)`` gives two; ``None`` stays ``None``; a single
    value becomes one ``StepOutput``. Raises ``ValueError`` when the microbatches
    returned differently structured values.
    """
    if not per_microbatch:
        raise ValueError("collect_step_outputs needs the output of at least one microbatch")
    return _collect(list(per_microbatch), "the step function's return value")


def _collect(values: list[Any], path: str) -> Any:
    first = values[0]
    shapes = [_structure(v) for v in values]
    if any(s != shapes[0] for s in shapes):
        raise ValueError(f"microbatches returned differently structured values for {path}: "
                         + ", ".join(f"microbatch {i}: {s}" for i, s in enumerate(shapes)))
    if first is None:
        return None
    if isinstance(first, (list, tuple)):
        items = [_collect([v[i] for v in values], f"{path}[{i}]") for i in range(len(first))]
        return _rebuild(first, items)
    if isinstance(first, dict):
        return _rebuild(first, {k: _collect([v[k] for v in values], f"{path}[{k!r}]")
                                for k in first})
    return StepOutput(values)


def _structure(obj: Any) -> str:
    """What must match across microbatches at one position (leaves only by being leaves)."""
    if obj is None:
        return "None"
    if isinstance(obj, (list, tuple)):
        return f"{type(obj).__name__} of length {len(obj)}"
    if isinstance(obj, dict):
        return f"{type(obj).__name__} with keys {sorted(map(repr, obj))}"
    return "a value"
