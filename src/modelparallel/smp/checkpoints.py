"""Checkpoints as SMP scripts call them: bound to the current ``mp.init()``, with the
model and optimizer defaulting to the ``DistributedModel`` / ``DistributedOptimizer``.
The work is done in ``modelparallel.checkpoint`` (this is ``mp.checkpoint``)."""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any

from torch import nn

from modelparallel.checkpoint import dcp, manager
from modelparallel.checkpoint.manager import info, newest
from modelparallel.checkpoint.storage import CheckpointError
from modelparallel.smp import registry
from modelparallel.smp.state import state


def save_checkpoint(path: str | os.PathLike, tag: str, partial: bool = True,
                    model: nn.Module | None = None, optimizer: Any = None,
                    user_content: Any = None, num_kept_partial_checkpoints: int | None = None,
                    translate_if_full: bool = True, **options: Any) -> None:
    """Save a resumable checkpoint as ``path/tag`` and make it the newest (collective).

    ``model`` and ``optimizer`` default to the ``DistributedModel`` /
    ``DistributedOptimizer``. The rest: :func:`modelparallel.checkpoint.manager.save_checkpoint`.
    """
    ctx = state.require("mp.save_checkpoint").context
    model, optimizer = _defaults(model, optimizer)
    manager.save_checkpoint(path, tag, partial, model, optimizer, user_content,
                            num_kept_partial_checkpoints, translate_if_full, ctx=ctx, **options)


def resume_from_checkpoint(path: str | os.PathLike, tag: str | None = None,
                           partial: bool = True, strict: bool = True,
                           load_optimizer: bool = True, *, model: nn.Module | None = None,
                           optimizer: Any = None, **options: Any) -> Any:
    """Load ``path/tag`` (default: the newest) and return its ``user_content`` (collective).

    ``model`` and ``optimizer`` default to the ``DistributedModel`` /
    ``DistributedOptimizer``; a ``DistributedModel`` that has not been split yet loads
    right after its split at the first step (as SMP does). The rest:
    :func:`modelparallel.checkpoint.manager.resume_from_checkpoint`.
    """
    ctx = state.require("mp.resume_from_checkpoint").context
    model, optimizer = _defaults(model, optimizer)
    return manager.resume_from_checkpoint(path, tag, partial, strict, load_optimizer,
                                          model=model, optimizer=optimizer, ctx=ctx, **options)


def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike,
         **options: Any) -> Any:
    return dcp.save(state_dict, checkpoint_id=checkpoint_id, ctx=state.context_or_none(),
                    **options)


def load(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike,
         **options: Any) -> None:
    dcp.load(state_dict, checkpoint_id=checkpoint_id, ctx=state.context_or_none(), **options)


def async_save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike,
               **options: Any) -> concurrent.futures.Future:
    return dcp.async_save(state_dict, checkpoint_id=checkpoint_id,
                          ctx=state.context_or_none(), **options)


save.__doc__ = dcp.save.__doc__
load.__doc__ = dcp.load.__doc__
async_save.__doc__ = dcp.async_save.__doc__


def _defaults(model: Any, optimizer: Any) -> tuple[Any, Any]:
    """SMP's defaults: the DistributedModel and its DistributedOptimizer of this init."""
    if model is None:
        model = registry.model()
    if optimizer is None and model is not None and model is registry.model():
        optimizer = registry.optimizer()
    return model, optimizer


__all__ = [
    "CheckpointError",
    "async_save",
    "info",
    "load",
    "newest",
    "resume_from_checkpoint",
    "save",
    "save_checkpoint",
]


def __getattr__(name: str) -> Any:
    """``mp.checkpoint`` is this module, while the path ``modelparallel.checkpoint`` is
    the core package: ``import modelparallel.checkpoint.utils as u`` (SMP v2's
    ``torch.sagemaker.checkpoint.utils``) reads the submodule through this attribute."""
    import importlib

    try:
        return importlib.import_module(f"modelparallel.checkpoint.{name}")
    except ModuleNotFoundError:
        raise AttributeError(f"module 'modelparallel.checkpoint' has no attribute "
                             f"{name!r}") from None
