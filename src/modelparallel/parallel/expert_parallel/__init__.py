"""Expert parallelism: the experts of each mixture-of-experts layer split over
``expert_parallel_degree`` data-parallel ranks, tokens sent to their experts and back by
all-to-all.

``ownership.py`` says which experts a rank holds, ``exchange.py`` is the differentiable
all-to-all, ``dispatch.py`` sends each token's choices to their experts and combines the
results, ``hugging_face.py`` finds a Hugging Face model's experts modules and splits
them, ``sharding.py`` shards the experts with FSDP2 over the ranks that hold the same
experts (``wrappers.py``: under torch's FSDP1 and ``mp.replicate`` too,
``fsdp1_states.py``: their FSDP1 optimizer state dicts), ``router_loss.py`` computes a
model's load-balancing loss over the whole batch (docs/expert-parallel.md).
"""

from __future__ import annotations

from torch import nn

from modelparallel.config import ConfigError
from modelparallel.context import ParallelContext
from modelparallel.module_state import lookup
from modelparallel.parallel.expert_parallel import router_loss
from modelparallel.topology import CommGroup

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
            f"load-balancing loss, over the whole batch) or 'none' (the model as configured)")
    if load_balancing == "aux_loss":
        _turn_on_router_loss(model, aux_loss_coeff)
    balance_over_batch(model, ctx)
    if ctx.ep_group is None:
        return model
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
    or with a pipeline (the loss and the routers live on different stages)."""
    if ctx.topology.pp == 1 and router_loss.has_router_loss(model):
        router_loss.install(model, ctx.process_group(CommGroup.RDP_GROUP))


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
    every rank, not as asked."""
    if ctx.topology.ep == 1:
        return
    if not split_experts(model):
        raise ConfigError([("expert_parallel_degree", (
            f"{ctx.topology.ep}, but the model given to {call} was not split over the "
            f"expert-parallel ranks: call tsm.transform(model, config=MoEConfig("
            f"smp_moe=False, moe_load_balancing='none')) first (as SMP v2 requires), or "
            f"set expert_parallel_degree to 1"))])
