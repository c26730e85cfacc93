"""``smdistributed.modelparallel.test.torch.utils``: saving a model's weights and
comparing two sets of them, as SMP v1's example scripts import them.

SMP never documented these internal test helpers; here ``dump_model`` writes the full
(gathered) state dict and ``verify`` compares two of them, naming the first tensor
that differs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def dump_model(model: nn.Module, path: str | os.PathLike = "model_dump.pt") -> str:
    """Save ``model``'s full state dict to ``path`` (rank 0 writes; every rank must call
    it when the model is split, since gathering it is collective). Returns the path."""
    import torch.distributed as dist

    state = model.state_dict()
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save({k: v.detach().cpu() if torch.is_tensor(v) else v
                    for k, v in state.items()}, path)
    return str(path)


def verify(expected: Mapping[str, Any] | str | os.PathLike,
           actual: Mapping[str, Any] | str | os.PathLike,
           rtol: float = 1e-5, atol: float = 1e-8) -> None:
    """Raise AssertionError naming the first key whose tensors differ (or that only one
    side has). Either side may be a path written by :func:`dump_model`."""
    a = _load(expected)
    b = _load(actual)
    if set(a) != set(b):
        raise AssertionError(f"different keys: only expected {sorted(set(a) - set(b))}, "
                             f"only actual {sorted(set(b) - set(a))}")
    for key in a:
        x, y = a[key], b[key]
        if torch.is_tensor(x) and torch.is_tensor(y):
            if x.shape != y.shape:
                raise AssertionError(f"{key}: shape {tuple(x.shape)} != {tuple(y.shape)}")
            if not torch.allclose(x.float(), y.float(), rtol=rtol, atol=atol):
                diff = (x.float() - y.float()).abs().max().item()
                raise AssertionError(f"{key}: differs by up to {diff:.3g} "
                                     f"(rtol={rtol}, atol={atol})")
        elif x != y:
            raise AssertionError(f"{key}: {x!r} != {y!r}")


def _load(source: Mapping[str, Any] | str | os.PathLike) -> Mapping[str, Any]:
    if isinstance(source, Mapping):
        return source
    return torch.load(source, map_location="cpu", weights_only=True)
