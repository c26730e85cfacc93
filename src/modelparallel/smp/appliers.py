"""SMP v2's appliers (``tsm.transform``, and ``mp.shard`` / ``mp.replicate``), bound to
the context of the current ``mp.init()``. The work is done in ``modelparallel.parallel``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from modelparallel.notices import notice
from modelparallel.observe.fit_check import warn_if_state_cannot_fit
from modelparallel.parallel import (
    context_parallel,
    expert_parallel,
    sharding,
    stale_params,
    unused_grads,
)
from modelparallel.parallel import replicate as replicating
from modelparallel.parallel.blocks import BlockSpec
from modelparallel.parallel.context_parallel.ring import COMM_TYPES
from modelparallel.parallel.expert_parallel import smp_layer
from modelparallel.parallel.expert_parallel import wrappers as expert_wrappers
from modelparallel.parallel.tensor import transform as splitting  # the module
from modelparallel.smp.state import state
from modelparallel.smp.v2.moe import MoEConfig


def transform(model: nn.Module, device: torch.device | str | None = None,
              dtype: torch.dtype | None = None, config: Any = None,
              load_state_dict_from_rank0: bool = False, cp_comm_type: str = "p2p", *,
              sequence_parallel: bool = False, loss_parallel: bool = False) -> nn.Module:
    ctx = state.require("mp.transform()").context
    if config is not None and not isinstance(config, MoEConfig):
        raise NotImplementedError(
            f"transform(config={config!r}): SMP's transformer configuration options are not "
            f"supported by modelparallel (it splits the model you pass as it is); pass "
            f"config=None or a MoEConfig")
    if isinstance(config, MoEConfig) and (why := config.refusal()) is not None:
        raise NotImplementedError(why)
    if isinstance(config, MoEConfig) and config.global_token_shuffle and ctx.topology.tp > 1:
        # the ranks of a tensor-parallel group hold the same tokens but sit in different
        # expert-parallel groups, whose permutations nothing makes agree
        raise NotImplementedError(
            f"MoEConfig(global_token_shuffle=True) with tensor_parallel_degree "
            f"{ctx.topology.tp} is not built yet; pass global_token_shuffle=False, or set "
            f"tensor_parallel_degree to 1")
    for ignored in config.ignored() if isinstance(config, MoEConfig) else []:
        notice("%s", ignored)
    if cp_comm_type not in COMM_TYPES:
        raise ValueError(f"cp_comm_type={cp_comm_type!r}; SMP accepts 'p2p' or 'all_gather'")
    if cp_comm_type != "p2p" and ctx.topology.cp == 1:
        notice("transform(cp_comm_type=%r) has no effect: context_parallel_degree is 1",
               cp_comm_type)
    before = dict(model.named_parameters())
    model = splitting.transform(model, ctx, sequence_parallel=sequence_parallel,
                                loss_parallel=loss_parallel, device=device, dtype=dtype,
                                weights_from_rank0=load_state_dict_from_rank0)
    model = context_parallel.apply(model, ctx, cp_comm_type)
    if isinstance(config, MoEConfig) and config.smp_moe:  # SMP's layer, then the split
        model = smp_layer.install(model, config.router_settings(),
                                  expert_parallel.batch_group(model, ctx), ctx.ep_group)
        model = expert_parallel.apply(model, ctx)
    elif isinstance(config, MoEConfig):
        model = expert_parallel.apply(model, ctx, config.moe_load_balancing,
                                      config.moe_aux_loss_coeff)
    stale_params.record_replaced(before, model, "mp.transform()")
    if ctx.topology.dp_shard == 1:  # else the sharding that follows checks
        warn_if_state_cannot_fit(model, ctx.rank, ctx.device, "mp.transform")
    return model


def shard(model: nn.Module, *, blocks: BlockSpec = None, reshard_after_forward: bool | None = None,
          mp_policy: MixedPrecisionPolicy | None = None, **fully_shard_kwargs: Any) -> nn.Module:
    ctx = state.require("mp.shard()").context
    context_parallel.require_split(model, ctx, "mp.shard()")
    expert_parallel.require_split(model, ctx, "mp.shard()")
    group = ctx.gradient_group(splitting.tp_ranks_are_replicas(
        model, ctx.topology.tp))
    before = dict(model.named_parameters())
    expert_parallel.balance_over_batch(model, ctx)
    model = sharding.shard(model, ctx, blocks=blocks, reshard_after_forward=reshard_after_forward,
                           mp_policy=mp_policy, **fully_shard_kwargs)
    stale_params.record_replaced(before, model, "mp.shard()")
    # parameters no data-parallel rank used keep no gradient, as in one process
    unused_grads.track_fsdp2(model, group, ctx.device)
    warn_if_state_cannot_fit(model, ctx.rank, ctx.device, "mp.shard")
    return model


def replicate(model: nn.Module, **ddp_kwargs: Any) -> nn.Module:
    ctx = state.require("mp.replicate()").context
    context_parallel.require_split(model, ctx, "mp.replicate()")
    group = ctx.gradient_group(splitting.tp_ranks_are_replicas(
        model, ctx.topology.tp))
    before = dict(model.named_parameters())
    expert_parallel.balance_over_batch(model, ctx)
    # the split experts: FSDP2 units replicated over their holders, which DDP leaves alone
    expert_wrappers.for_replicate(model, ctx)
    model = replicating.replicate(model, ctx, **ddp_kwargs)
    stale_params.record_replaced(before, model, "mp.replicate()")  # DDP: none
    # a tensor-parallel model's replicas are FSDP2's (DDP finds unused parameters itself)
    unused_grads.track_fsdp2(model, group, ctx.device)
    return model


transform.__doc__ = (splitting.transform.__doc__ or "") + """
    SMP v2's arguments: ``load_state_dict_from_rank0`` is ``weights_from_rank0`` above;
    ``config``: a ``MoEConfig(smp_moe=False, moe_load_balancing="none" or "aux_loss")``
    splits a Hugging Face mixture-of-experts model's experts over
    ``expert_parallel_degree`` ranks and computes its load-balancing loss over the whole
    batch (docs/expert-parallel.md); SMP's transformer options raise NotImplementedError.

    With ``context_parallel_degree`` > 1 the model (a Hugging Face Llama, Mistral,
    Qwen2/3 or GPT-NeoX causal LM) then takes this rank's chunks of each sequence (SMP's
    split: ``mp.split_for_context_parallel``) and trains as one process on the whole
    sequences; ``cp_comm_type`` chooses how keys and values travel: ``"p2p"`` (a ring
    overlapping attention) or ``"all_gather"`` (docs/context-parallel.md).
    """
shard.__doc__ = sharding.shard.__doc__
replicate.__doc__ = replicating.replicate.__doc__
