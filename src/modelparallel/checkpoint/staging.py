"""The CPU copy an ``async_save`` writes from, kept from one save to the next.

``async_save`` must copy the state before it returns (training then changes it). torch's
``DefaultStager`` deep-copies the state dict on every call: for each DTensor it builds a
new DTensor (a dispatch through DTensor's machinery), which on the bench's model costs
about as much as copying the bytes. :class:`ReusedStaging` builds the copy once per
structure of the state dict (keys, and per tensor its type, dtype, shapes, placements
and mesh) and afterwards only copies each tensor's local data into it: the cost of an
``async_save`` call comes down to that one memory copy.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor


def _leaves(obj: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    """(path, value) of every leaf of nested dicts and lists, in order."""
    if isinstance(obj, dict):
        return [leaf for k, v in obj.items() for leaf in _leaves(v, (*path, k))]
    if isinstance(obj, list | tuple):
        return [leaf for i, v in enumerate(obj) for leaf in _leaves(v, (*path, i))]
    return [(path, obj)]


def _signature(path: tuple, value: Any, local: torch.Tensor | None) -> tuple:
    if type(value) is DTensor and value.device_mesh.device_type == "cpu":
        assert local is not None
        return (path, "dtensor", value.dtype, tuple(value.shape), tuple(local.shape),
                tuple(value.stride()), value.device_mesh, tuple(value.placements))
    if type(value) is torch.Tensor:
        return (path, "tensor", value.dtype, tuple(value.shape))
    if isinstance(value, torch.Tensor):  # on an accelerator's mesh, ShardedTensor, ...
        return (path, "other")
    return (path, type(value).__name__)


def _structure(obj: Any) -> tuple:
    """What a reused copy must agree on; also the containers' types."""
    if isinstance(obj, dict):
        return ("dict", tuple((k, _structure(v)) for k, v in obj.items()))
    if isinstance(obj, list | tuple):
        return (type(obj).__name__, tuple(_structure(v) for v in obj))
    return ("leaf",)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _rebuild(template: Any, leaves: list[Any]) -> Any:
    """``template``'s containers with ``leaves`` (consumed in order) as their leaves."""
    if isinstance(template, dict):
        return {k: _rebuild(v, leaves) for k, v in template.items()}
    if isinstance(template, list | tuple):
        return type(template)(_rebuild(v, leaves) for v in template)
    return leaves.pop(0)


class ReusedStaging(AsyncStager):
    """An ``AsyncStager`` (blocking: the copy is done when :meth:`stage` returns) that
    keeps the CPU copy of the last structure it staged and copies into it. The caller
    must make sure no save still writes from the copy when it stages again."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._copies: list[torch.Tensor] = []  # the copy's tensors (DTensors), leaf order
        self._locals: list[torch.Tensor] = []  # their local tensors, copied into
        self._fallback = DefaultStager(StagingOptions(use_pinned_memory=False,
                                                      use_shared_memory=False,
                                                      use_async_staging=False,
                                                      use_non_blocking_copy=False))

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        leaves = _leaves(state_dict)
        sources = [_local(v) if isinstance(v, torch.Tensor) else None for _, v in leaves]
        key = (_structure(state_dict),
               tuple(_signature(p, v, s) for (p, v), s in zip(leaves, sources, strict=True)))
        if any(s[1] == "other" for s in key[1]):  # tensors it does not rebuild: torch's
            self._forget()
            return self._fallback.stage(state_dict)  # type: ignore[return-value]
        if key != self._key:
            self._forget()  # the old copy goes before the new one is made
            self._copy_like([v for _, v in leaves if isinstance(v, torch.Tensor)])
            self._key = key
        for copied, source in zip(self._locals, (s for s in sources if s is not None),
                                  strict=True):
            copied.copy_(source)
        copies = iter(self._copies)
        return _rebuild(state_dict, [next(copies) if isinstance(v, torch.Tensor) else
                                     copy.deepcopy(v) for _, v in leaves])

    def _copy_like(self, tensors: list[torch.Tensor]) -> None:
        for value in tensors:
            local = torch.empty(_local(value).shape, dtype=value.dtype, device="cpu")
            copied = local
            if isinstance(value, DTensor):
                dtensor = DTensor.from_local(local, value.device_mesh, value.placements,
                                             run_check=False, shape=value.shape,
                                             stride=value.stride())
                copied, local = dtensor, dtensor.to_local()  # its own (the same memory)
            self._copies.append(copied)
            self._locals.append(local)

    def _forget(self) -> None:
        self._key, self._copies, self._locals = None, [], []

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` copies before it returns."""

    def close(self) -> None:
        self._forget()
        self._fallback.close()
