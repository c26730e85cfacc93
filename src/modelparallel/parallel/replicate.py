"""Replicated data parallelism (DDP) over the data-parallel ranks, when nothing is sharded."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate as replicate_dtensors
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from modelparallel.config import ConfigError
from modelparallel.context import ParallelContext
from modelparallel.parallel import expert_parallel, replicas
from modelparallel.parallel.blocks import find_blocks
from modelparallel.parallel.precision import compute_as
from modelparallel.parallel.sharding import replicate_on_tp, say_what_does_not_apply
from modelparallel.parallel.tensor.transform import tp_ranks_are_replicas


def replicate(model: nn.Module, ctx: ParallelContext, **ddp_kwargs: Any) -> nn.Module:
    """Replicate ``model`` over the reduced data-parallel group (same stage, same TP shard);
    gradients are averaged over it after every backward.

    A plain model is wrapped in ``torch.nn.parallel.DistributedDataParallel``
    (``device_ids`` defaults to this rank's GPU on CUDA; other keyword arguments go to
    DDP unchanged), which starts every replica from the first one's values. A model
    tensor parallelism did not split is replicated over the tensor-parallel ranks too
    (each trains it on its own batch). A tensor-parallel model (DTensor parameters) is
    replicated in place by PyTorch's DTensor-aware DDP (``replicate`` built on FSDP2's
    machinery, one gradient bucket per block) and returned as it is: classic DDP does
    not understand DTensor parameters; its whole parameters become ``Replicate()``
    DTensors on ``tp`` first, as under ``mp.shard`` (``sharding.replicate_on_tp``).
    Experts expert parallelism split are replicated over the ranks holding the same
    experts, outside DDP (``expert_parallel/wrappers.py``).
    ``bf16``/``fp16`` make the forward and backward compute in that type with float32
    parameters and gradients (with ``fp16``, scale the loss with :class:`mp.LossScaler`).
    """
    _check_replicated_layout(ctx)
    say_what_does_not_apply(ctx, "mp.replicate()")
    blocks = find_blocks(model)
    compute_as(model, ctx.precision, blocks)
    experts = {id(p) for p in expert_parallel.expert_parameters(model)}  # FSDP2's already
    if any(isinstance(p, DTensor) and id(p) not in experts for p in model.parameters()):
        if ddp_kwargs:
            raise TypeError(f"mp.replicate() of a tensor-parallel model takes no DDP arguments "
                            f"(got {sorted(ddp_kwargs)})")
        replicas.synchronize(model, ctx)
        replicate_on_tp([model], ctx.meshes["tp"])  # one mesh for torch's clip_grad_norm_
        mesh = ctx.meshes["rdp"]
        for block in blocks:
            replicate_dtensors(block, mesh=mesh)
        replicate_dtensors(model, mesh=mesh)
        return model
    if ctx.device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [ctx.device.index])
        model = model.to(ctx.device)
    group = ctx.gradient_group(tp_ranks_are_replicas(model, ctx.topology.tp))
    ddp_kwargs.setdefault("process_group", group)
    return DistributedDataParallel(model, **ddp_kwargs)


def _check_replicated_layout(ctx: ParallelContext) -> None:
    """Replicating where the configuration asks for sharding is refused, not ignored."""
    c = ctx.config
    if not ctx.data_parallel.explicit_sharding:
        return
    if c.sharded_data_parallel_degree > 1:
        raise ConfigError([("sharded_data_parallel_degree", (
            f"{c.sharded_data_parallel_degree} asks for sharded data parallelism, but "
            "mp.replicate() replicates; use mp.shard(), or drop the key"))])
    raise ConfigError([("hybrid_shard_degree", (
        f"{c.hybrid_shard_degree} shards parameters over {ctx.topology.dp_shard} ranks, but "
        "mp.replicate() replicates; use mp.shard(), or set hybrid_shard_degree to 1"))])
