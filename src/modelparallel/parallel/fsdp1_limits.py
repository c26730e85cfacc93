"""What torch's FSDP1 cannot do on the layouts modelparallel gives it: said up front,
or made to work.

Each check turns a torch failure deep inside FSDP1 (or a silently wrong model) into a
``ConfigError`` naming the cause and the way out, raised the same way on every rank
before FSDP1 runs a collective or, for what the script does later, when it does it.
:func:`_grad_views` keeps the gradients of a tensor-parallel model sharded over
one-rank groups where backward can accumulate onto them, so any order of
``zero_grad``, forward, backward and step, and accumulation over several backward
passes, train as in one process.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
from torch.distributed.fsdp._flat_param import FlatParamHandle

from modelparallel.config import ConfigError
from modelparallel.module_state import lookup, state_of
from modelparallel.parallel.tensor.transform import tied_groups

logger = logging.getLogger("modelparallel")


def check_module(module: nn.Module, split: bool) -> None:
    """Before construction: tied parameters of a tensor-parallel model."""
    if not split:
        return
    tied = [[f"{type(m).__name__}.{n}" for m, n in group] for group in tied_groups(module)]
    if tied:
        raise ConfigError([("tensor_parallel_degree", (
            f"FSDP1 flattens the tied parameters {tied[0]} of this tensor-parallel model as "
            "separate tensors, so they would be trained apart; wrap it with mp.shard() "
            "(FSDP2), which keeps them tied, or untie them"))])


def guard(model: FullyShardedDataParallel, split: bool, use_orig_params: bool) -> None:
    """After construction: what the script may do later that FSDP1 cannot follow."""
    if split and use_orig_params:
        for unit in FullyShardedDataParallel.fsdp_modules(model):
            handle = unit._handle  # private: the unit's FlatParamHandle
            if handle is not None and handle.uses_sharded_strategy and unit.world_size == 1:
                _ONE_RANK_SHARDS.add(handle)  # read by _grad_views
        FlatParamHandle._use_unsharded_grad_views = _grad_views  # type: ignore[method-assign]
        model.no_sync = functools.partial(  # type: ignore[method-assign]
            _synchronised_no_sync, model)
    shared = bool(tied_groups(model.module))
    if (model.sharding_strategy == ShardingStrategy.NO_SHARD and shared
            and model.mixed_precision.param_dtype not in (None, torch.float32)):
        model.no_sync = functools.partial(  # type: ignore[method-assign,assignment]
            _no_sync_refused, model.mixed_precision.param_dtype)


# private: FSDP1's FlatParamHandle, and its method that points the original parameters'
# gradients into the unsharded flat gradient (tested by tests/distributed/
# test_fsdp1_grad_orders.py, which fails if torch changes it)
_torch_unsharded_grad_views = FlatParamHandle._use_unsharded_grad_views
_ONE_RANK_SHARDS: weakref.WeakSet[FlatParamHandle] = weakref.WeakSet()


def _grad_views(handle: Any) -> None:
    """A tensor-parallel unit sharded over one rank (``fsdp1_torch.keep_sharded_strategy``)
    has a sharded gradient of the unsharded size, which FSDP1 takes, after a forward, for
    one ``no_sync()`` kept unsharded (never kept here: ``_synchronised_no_sync``). It then
    pointed the original parameters' gradients at tensor-parallel views of it that its
    next backward cannot write back ("invalid python storage") and ``zero_grad(set_to_none=
    False)`` ends the process on: every backward after one whose gradients were not set
    to None. They stay on the sharded gradient, as with more ranks."""
    flat = handle.flat_param
    if handle in _ONE_RANK_SHARDS and flat.grad is not None \
            and not hasattr(flat, "_saved_grad_shard"):  # set when gathered on purpose
        return
    _torch_unsharded_grad_views(handle)


@contextlib.contextmanager
def _synchronised_no_sync(model: FullyShardedDataParallel) -> Iterator[None]:
    # with use_orig_params, torch's FSDP1 keeps a tensor-parallel model's unsharded
    # gradients as DTensors in no_sync() and then fails writing them back ("invalid
    # python storage") on the next forward; reduced in every backward, the gradients
    # accumulate all the same
    if not lookup(model, "no_sync_noted", False):
        state_of(model).no_sync_noted = True
        if torch.distributed.get_rank() == 0:
            logger.warning("no_sync() has no effect on this tensor-parallel FSDP1 model: "
                           "with use_orig_params=True torch's FSDP1 cannot hold its "
                           "unsharded gradients, so every "
                           "backward reduces them (they accumulate all the same); "
                           "mp.shard() (FSDP2) skips the reduction")
    yield


def _no_sync_refused(dtype: torch.dtype) -> None:
    raise ConfigError([("bf16" if dtype == torch.bfloat16 else "fp16", (
        "FSDP1 cannot accumulate gradients in no_sync() for a model with tied parameters "
        f"in {dtype} mixed precision when it does not shard (NO_SHARD; torch's own fails "
        "assigning the half-precision gradient): accumulate with synchronised backward "
        "passes (without no_sync), shard the model (hybrid_shard_degree >= 2 or 0), or use "
        "mp.shard() (FSDP2)"))])
