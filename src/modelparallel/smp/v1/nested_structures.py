"""``smdistributed.modelparallel.torch.utils``: SMP v1's general helpers for nested
structures of tensors, the ones that do not reach into its runtime.

No public SageMaker example imports this module; these are the functions of it that a
script could use without SMP's internals (``map_structure``, ``flatten_structure`` /
``unflatten_structure``, ``convert_args_to_device``, ``rmsg``, sizes). The rest of
SMP's module serves its own pipeline runtime, which modelparallel does not have.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

_structures: dict[int, Any] = {}  # structure_id -> the shape of a flattened structure


def is_instance_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and type(obj).__base__ is tuple and hasattr(obj, "_fields")


def map_structure(fn: Callable[[Any], Any], structure: Any) -> Any:
    """``fn`` applied to every leaf of nested lists, tuples (named too), sets and dicts."""
    if isinstance(structure, (list, tuple, set)):
        items = [map_structure(fn, x) for x in structure]
        if is_instance_namedtuple(structure):
            return type(structure)(*items)
        return type(structure)(items)
    if isinstance(structure, dict):
        out = collections.defaultdict(structure.default_factory) \
            if isinstance(structure, collections.defaultdict) else type(structure)()
        for k, v in structure.items():
            out[k] = map_structure(fn, v)
        return out
    return fn(structure)


def flatten_structure(structure: Any) -> tuple[list[Any], int]:
    """The leaves of ``structure`` in order, and an id :func:`unflatten_structure` takes."""
    leaves: list[Any] = []

    def take(leaf: Any) -> int:
        leaves.append(leaf)
        return len(leaves) - 1

    shape = map_structure(take, structure)
    structure_id = len(_structures)
    _structures[structure_id] = shape
    return leaves, structure_id


def unflatten_structure(flat: list[Any], structure_id: int) -> Any:
    """The structure ``flatten_structure`` returned ``structure_id`` for, with ``flat``
    as its leaves."""
    return map_structure(lambda i: flat[i], _structures[structure_id])


def convert_args_to_device(args: tuple, kwargs: dict, device: torch.device | str,
                           only_convert_gpu_tensors: bool = False) -> tuple[tuple, dict]:
    def move(x: Any) -> Any:
        if torch.is_tensor(x) and (not only_convert_gpu_tensors or x.is_cuda):
            return x.to(device)
        return x

    return map_structure(move, (args, kwargs))


def rmsg(msg: str) -> str:
    """``msg`` prefixed with this process's rank, as SMP's log lines are."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    return f"[{rank}] {msg}"


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def get_tensor_size(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


def product(xs: Iterable[int]) -> int:
    return math.prod(xs)


def get_distribution_axis(param: torch.Tensor) -> int | None:
    """The dimension tensor parallelism split ``param`` along, or None if it is whole
    on every tensor-parallel rank (SMP's fp16 utilities use it to gather parameters)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return None
    names = param.device_mesh.mesh_dim_names or ()
    for name, placement in zip(names, param.placements, strict=True):
        if name == "tp" and isinstance(placement, Shard):
            return placement.dim
    return None


__all__ = ["convert_args_to_device", "dtype_size", "flatten_structure", "get_distribution_axis",
           "get_tensor_size",
           "is_instance_namedtuple", "map_structure", "product", "rmsg", "unflatten_structure"]
