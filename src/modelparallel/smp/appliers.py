"""SMP v2's appliers (``tsm.transform``, and ``mp.shard`` / ``mp.replicate``), bound to
the context of the current ``mp.init()``. The work is done in ``modelparallel.parallel``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from modelparallel.parallel import replicate as replicating
from modelparallel.parallel import sharding
from modelparallel.parallel.blocks import BlockSpec
from modelparallel.parallel.tensor import transform as splitting  # the module
from modelparallel.smp.state import state


def transform(model: nn.Module, *, sequence_parallel: bool = False, loss_parallel: bool = False,
              device: torch.device | str | None = None,
              dtype: torch.dtype | None = None) -> nn.Module:
    ctx = state.require("mp.transform()").context
    return splitting.transform(model, ctx, sequence_parallel=sequence_parallel,
                               loss_parallel=loss_parallel, device=device, dtype=dtype)


def shard(model: nn.Module, *, blocks: BlockSpec = None, reshard_after_forward: bool | None = None,
          mp_policy: MixedPrecisionPolicy | None = None, **fully_shard_kwargs: Any) -> nn.Module:
    ctx = state.require("mp.shard()").context
    return sharding.shard(model, ctx, blocks=blocks, reshard_after_forward=reshard_after_forward,
                          mp_policy=mp_policy, **fully_shard_kwargs)


def replicate(model: nn.Module, **ddp_kwargs: Any) -> nn.Module:
    ctx = state.require("mp.replicate()").context
    return replicating.replicate(model, ctx, **ddp_kwargs)


transform.__doc__ = splitting.transform.__doc__
shard.__doc__ = sharding.shard.__doc__
replicate.__doc__ = replicating.replicate.__doc__
