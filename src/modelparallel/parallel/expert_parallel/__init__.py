"""Expert parallelism: the experts of each mixture-of-experts layer split over
``expert_parallel_degree`` data-parallel ranks, tokens sent to their experts and back by
all-to-all.

``ownership.py`` says which experts a rank holds, ``exchange.py`` is the differentiable
all-to-all, ``dispatch.py`` sends each token's choices to their experts and combines the
results, ``hugging_face.py`` finds a Hugging Face model's experts modules and splits
them, ``sharding.py`` shards the experts with FSDP2 over the ranks that hold the same
experts (``wrappers.py``: under torch's FSDP1 and ``mp.replicate`` too,
``fsdp1_states.py``: their FSDP1 optimizer state dicts), ``router_loss.py`` computes a
model's load-balancing loss over the whole batch, ``smp_layer.py`` and ``smp_router.py``
are SMP's own MoE layer (``smp_moe=True``), ``token_shuffle.py`` its global token
shuffle (docs/expert-parallel.md).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from modelparallel.config import ConfigError
from modelparallel.context import ParallelContext
from modelparallel.module_state import lookup
from modelparallel.parallel.expert_parallel import router_loss
from modelparallel.parallel.placement import tp_ranks_are_replicas

LOAD_BALANCING = ("aux_loss", "sinkhorn", "balanced", "none")
BUILT_LOAD_BALANCING = ("aux_loss", "none")


def apply(model: nn.Module, ctx: ParallelContext, load_balancing: str = "none",
          aux_loss_coeff: float | None = None) -> nn.Module:
    """Split ``model``'s experts over this rank's expert-parallel group (nothing to do with
    ``expert_parallel_degree`` 1), and compute the model's load-balancing loss over the
    whole batch (:func:`balance_over_batch`). ``load_balancing`` is SMP's
    ``moe_load_balancing``: ``"none"`` keeps the model's configuration, ``"aux_loss"``
    turns the model's own load-balancing loss on with weight ``aux_loss_coeff``."""
    if load_balancing not in LOAD_BALANCING:
        raise ValueError(f"moe_load_balancing={load_balancing!r}; SMP accepts "
                         f"{', '.join(map(repr, LOAD_BALANCING))}")
    if load_balancing not in BUILT_LOAD_BALANCING:
        raise NotImplementedError(
            f"moe_load_balancing={load_balancing!r} is not built yet (it depends on the set "
            f"of tokens each rank routes); use moe_load_balancing='aux_loss' (the model's own "
            f"load-balancing loss, over the whole batch) or 'none' (the model as configured), "
            f"or MoEConfig(smp_moe=True) (SMP's own MoE layer, which builds it)")
    if load_balancing == "aux_loss":
        _turn_on_router_loss(model, aux_loss_coeff)
    balance_over_batch(model, ctx)
    if ctx.ep_group is None:
        return model
    if tp_ranks_are_replicas(model, ctx.topology.tp):
        # its tensor-parallel ranks would train their own rows, each with its own copy of
        # its experts: their gradients would never meet
        raise ConfigError([("expert_parallel_degree", (
            f"{ctx.topology.ep} with tensor_parallel_degree={ctx.topology.tp} needs a model "
            f"tensor parallelism splits (Mixtral, Qwen2-MoE and Qwen3-MoE have plans); "
            f"{type(model).__name__} has none, so its tensor-parallel ranks would be "
            f"data-parallel replicas with experts of their own: register a plan "
            f"(tp_register_with_module), or set one of the degrees to 1"))])
    from modelparallel.parallel.expert_parallel import hugging_face

    return hugging_face.install(model, ctx.ep_group, ctx.topology.ep_rank(ctx.rank),
                                ctx.meshes["experts"])


def _turn_on_router_loss(model: nn.Module, coefficient: float | None) -> None:
    """``moe_load_balancing='aux_loss'``: the model adds its routers' load-balancing loss
    (``config.output_router_logits``), weighted by ``coefficient`` (SMP's
    ``moe_aux_loss_coeff``) when given, else by the model's ``router_aux_loss_coef``."""
    if not router_loss.has_router_loss(model):
        raise ConfigError([("moe_load_balancing", (
            f"'aux_loss' needs a model that adds its routers' load-balancing loss "
            f"(output_router_logits and router_aux_loss_coef, as Hugging Face's Mixtral, "
            f"Qwen2-MoE, Qwen3-MoE and OLMoE); {type(model).__name__} has none: pass "
            f"moe_load_balancing='none'"))])
    config = getattr(model, "config")  # noqa: B009 (a Hugging Face model's; mypy types it)
    config.output_router_logits = True
    if coefficient is not None:
        config.router_aux_loss_coef = coefficient
        setattr(model, "router_aux_loss_coef", coefficient)  # noqa: B010 (read by forward)


def balance_over_batch(model: nn.Module, ctx: ParallelContext) -> None:
    """Make ``model``'s own load-balancing loss (Hugging Face MoE models, when a call asks
    for it) one process's over the whole batch: its statistics summed over the ranks
    holding different samples (router_loss.py). Nothing for other models, on one rank,
    or with a pipeline (the loss and the routers live on different stages). The ranks of
    a tensor-parallel group run the same tokens when tensor parallelism split the model,
    and their own rows when it did not (replicas: they are summed over too)."""
    if ctx.topology.pp == 1 and router_loss.has_router_loss(model):
        router_loss.install(model, batch_group(model, ctx))


def batch_group(model: nn.Module, ctx: ParallelContext) -> dist.ProcessGroup:
    """The ranks whose rows make one process's batch, over which a load-balancing loss's
    statistics are summed: the data-parallel ranks, and the tensor-parallel ones too when
    tensor parallelism left ``model`` whole (they are replicas with rows of their own)."""
    readers = ctx.data_parallel.averaging(tp_ranks_are_replicas(model, ctx.topology.tp))
    return ctx.process_group(readers)


def split_experts(model: nn.Module) -> list[nn.Module]:
    """The experts modules :func:`apply` split in ``model`` (none if it split none)."""
    found = lookup(model, "expert_parallel")
    return list(found) if isinstance(found, list) else []


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model``'s split experts: each rank holds its own experts'."""
    return [p for module in split_experts(model) for p in module.parameters()]


def require_split(model: nn.Module, ctx: ParallelContext, call: str) -> None:
    """Refuse a model ``tsm.transform`` did not split when ``expert_parallel_degree`` > 1:
    ``call`` (``mp.shard()``, ``mp.replicate()``, FSDP1) would train every expert on
    every rank, not as asked; and tensor parallelism with it under a wrapper other than
    ``mp.shard`` (not built)."""
    if ctx.topology.ep == 1:
        return
    if ctx.topology.tp > 1 and call != "mp.shard()":
        raise ConfigError([("expert_parallel_degree", (
            f"{ctx.topology.ep} with tensor_parallel_degree {ctx.topology.tp} under {call} "
            f"is not built yet (expert and tensor parallelism together are built under "
            f"mp.shard); wrap the model with mp.shard(), or set one of the two to 1"))])
    if not split_experts(model):
        raise ConfigError([("expert_parallel_degree", (
            f"{ctx.topology.ep}, but the model given to {call} was not split over the "
            f"expert-parallel ranks: call tsm.transform(model, config=MoEConfig("
            f"smp_moe=False, moe_load_balancing='none')) first (as SMP v2 requires), or "
            f"set expert_parallel_degree to 1"))])
