"""An optimizer holding parameters the model no longer trains is refused at its first step.

``mp.transform`` (tensor parallelism), ``mp.shard`` (FSDP2), FSDP1, ``mp.replicate`` of a
tensor-parallel model and ``mp.DistributedModel``'s first step replace a model's
parameters by new tensors. An optimizer made from ``model.parameters()`` before that
holds the old ones, which the model no longer reads: it steps them, and the model never
changes (raw FSDP2 behaves so too, without a word). Each applier records what it
replaced (:func:`record_replaced`, weakly: nothing is kept alive); torch's global
optimizer step pre-hook looks at each optimizer once, at its first step, and refuses
one that holds a replaced parameter. An optimizer made before ``mp.replicate`` of a
plain model is fine: DDP keeps the parameters. ``mp.DistributedOptimizer`` swaps the
replaced parameters of ``DistributedModel`` for their successors before its wrapped
optimizer steps, so an SMP v1 script may build it before the first step.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

# id of a replaced parameter -> (a weak reference to it, its name, what replaced it, the
# way out)
_REPLACED: dict[int, tuple[weakref.ref[torch.Tensor], str, str, str]] = {}
_CHECKED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_installed: list[Any] = []


def record_replaced(before: Mapping[str, torch.Tensor], model: nn.Module, by: str,
                    fix: str | None = None) -> None:
    """Remember the parameters of ``before`` (name -> parameter, taken before ``by``
    changed ``model``) that ``model`` no longer holds; ``fix`` is the way out the
    refusal names (default: build the optimizer after ``by``)."""
    now = {id(p) for p in model.parameters()}
    fix = fix or f"build the optimizer after {by}, from the parameters of the model it returns"
    for name, p in before.items():
        if id(p) not in now:
            _remember(p, name, by, fix)


def _remember(p: torch.Tensor, name: str, by: str, fix: str) -> None:
    if not _installed:
        _installed.append(register_optimizer_step_pre_hook(_first_step))
    key = id(p)

    def forget(ref: weakref.ref[torch.Tensor]) -> None:
        if _REPLACED.get(key, (None,))[0] is ref:
            del _REPLACED[key]

    _REPLACED[key] = (weakref.ref(p, forget), name, by, fix)


def _first_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _CHECKED:
        return
    stale = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _REPLACED.get(id(p))
            if entry is not None and entry[0]() is p:
                stale.append(entry)
    if stale:
        _, name, by, fix = stale[0]
        raise RuntimeError(
            f"this {type(optimizer).__name__} holds {len(stale)} parameter(s) that {by} "
            f"replaced (the first: {name!r}), which the model no longer trains: {fix}")
    _CHECKED.add(optimizer)
