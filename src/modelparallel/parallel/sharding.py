"""Hybrid sharded data parallelism with FSDP2 (``fully_shard``) on the data-parallel mesh."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from modelparallel.config import Config
from modelparallel.parallel.blocks import BlockSpec, find_blocks
from modelparallel.state import State, state

logger = logging.getLogger("modelparallel")

_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def data_parallel_mesh(s: State):
    """The mesh FSDP works on: ``dp_shard`` alone, or ``(dp_replicate, dp_shard)`` for HSDP."""
    if s.topology.dp_replicate == 1:
        return s.meshes["dp_shard"]
    return s.mesh["dp_replicate", "dp_shard"]


def mixed_precision_policy(config: Config) -> MixedPrecisionPolicy:
    """bf16/fp16 compute with fp32 gradient reduction, or full fp32."""
    half = config.half_precision
    if half is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=_HALF[half], reduce_dtype=torch.float32)


def shard(model: nn.Module, *, blocks: BlockSpec = None, reshard_after_forward: bool = True,
          mp_policy: MixedPrecisionPolicy | None = None, **fully_shard_kwargs) -> nn.Module:
    """Shard ``model`` with FSDP2 following ``hybrid_shard_degree``; returns the model.

    Applies ``fully_shard`` bottom-up: each repeated block (found automatically, or
    ``blocks=``: module classes, modules or a predicate), then the root. Parameters
    are sharded over ``dp_shard`` ranks and replicated over ``dp_replicate`` ranks
    (hybrid_shard_degree 0: shard over all data-parallel ranks; 1: replicate; k:
    shard over k). ``reshard_after_forward=False`` keeps gathered parameters from
    forward to backward (ZeRO-2 flavour). ``bf16``/``fp16`` in the config select a
    mixed-precision policy unless ``mp_policy`` is given.
    """
    s = state.require("mp.shard()")
    mesh = data_parallel_mesh(s)
    policy = mp_policy or mixed_precision_policy(s.config)
    units = find_blocks(model, blocks)
    if not units and s.rank == 0:
        logger.warning("mp.shard(): found no repeated blocks in %s; the whole model is one "
                       "FSDP unit (pass blocks=[...] to choose them)", type(model).__name__)
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=policy, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward,
                mp_policy=policy, **fully_shard_kwargs)
    return model
