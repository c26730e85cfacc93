"""Unchanged FSDP1 scripts follow ``hybrid_shard_degree`` (SMP v2's rules).

After ``mp.init()``, ``FullyShardedDataParallel(model, ...)`` constructed exactly as
before is given our data-parallel process groups:

- ``hybrid_shard_degree`` 0: PyTorch's own behaviour (only ``device_id`` is filled in
  on CPU-only machines, where FSDP1 would otherwise refuse to start);
- 1: ``NO_SHARD`` over the data-parallel ranks;
- k: shard over k ranks. An unset strategy becomes ``HYBRID_SHARD`` (``FULL_SHARD``
  when k is every data-parallel rank); an explicit ``HYBRID_SHARD`` or
  ``_HYBRID_SHARD_ZERO2`` keeps its flavour; ``FULL_SHARD``/``SHARD_GRAD_OP`` become
  their hybrid twins; ``NO_SHARD`` is kept.

An explicit ``process_group`` or ``device_mesh`` is the script's own choice and is
left alone.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

from modelparallel.state import State, state

logger = logging.getLogger("modelparallel")

_S = ShardingStrategy
_TO_HYBRID = {None: _S.HYBRID_SHARD, _S.FULL_SHARD: _S.HYBRID_SHARD,
              _S.SHARD_GRAD_OP: _S._HYBRID_SHARD_ZERO2, _S.HYBRID_SHARD: _S.HYBRID_SHARD,
              _S._HYBRID_SHARD_ZERO2: _S._HYBRID_SHARD_ZERO2, _S.NO_SHARD: _S.NO_SHARD}
_TO_FLAT = {None: _S.FULL_SHARD, _S.FULL_SHARD: _S.FULL_SHARD,
            _S.SHARD_GRAD_OP: _S.SHARD_GRAD_OP, _S.HYBRID_SHARD: _S.FULL_SHARD,
            _S._HYBRID_SHARD_ZERO2: _S.SHARD_GRAD_OP, _S.NO_SHARD: _S.NO_SHARD}
_original_init = FullyShardedDataParallel.__init__
_signature = inspect.signature(_original_init)


def fsdp1_arguments(s: State, arguments: dict[str, Any]) -> dict[str, Any]:
    """The FSDP1 constructor arguments after applying the hybrid sharding policy."""
    args = dict(arguments)
    if not torch.cuda.is_available() and args.get("device_id") is None:
        args["device_id"] = torch.device("cpu")
    if args.get("process_group") is not None or args.get("device_mesh") is not None:
        return args  # the script chose its own groups
    cfg, topo = s.config, s.topology
    if cfg.hybrid_shard_degree == 0 and cfg.sharded_data_parallel_degree <= 1 and topo.tp == 1:
        return args  # SMP v2: 0 means PyTorch's own behaviour
    asked = args.get("sharding_strategy")
    # Meshes, not bare process groups: FSDP1 finds tensor-parallel DTensor parameters'
    # mesh through the data-parallel mesh's root.
    if topo.dp_shard == 1:
        strategy, groups = _S.NO_SHARD, {"device_mesh": s.meshes["rdp"]}
    elif topo.dp_replicate == 1:
        strategy = _TO_FLAT[asked]
        groups = {"device_mesh": s.meshes["dp_shard"]}
    else:
        strategy = _TO_HYBRID[asked]
        groups = {"device_mesh": s.mesh["dp_replicate", "dp_shard"]}
        if strategy is _S.NO_SHARD:
            groups = {"device_mesh": s.meshes["rdp"]}
    if asked not in (None, strategy) and s.rank == 0:
        logger.warning("FSDP sharding_strategy %s becomes %s to follow hybrid_shard_degree=%d",
                       asked.name, strategy.name, topo.dp_shard)
    args.update(groups, sharding_strategy=strategy)
    return args


@functools.wraps(_original_init)
def _init_with_policy(self, module, *args, **kwargs):
    if not state.initialized:
        return _original_init(self, module, *args, **kwargs)
    bound = _signature.bind(self, module, *args, **kwargs)
    arguments = {k: v for k, v in bound.arguments.items() if k not in ("self", "module")}
    return _original_init(self, module, **fsdp1_arguments(state, arguments))


def install() -> None:
    """Route FSDP1 construction through the policy (idempotent; inert before init)."""
    FullyShardedDataParallel.__init__ = _init_with_policy
