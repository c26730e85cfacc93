"""Expert parallelism: the experts of each mixture-of-experts layer split over
``expert_parallel_degree`` data-parallel ranks, tokens sent to their experts and back by
all-to-all.

``ownership.py`` says which experts a rank holds, ``exchange.py`` is the differentiable
all-to-all, ``dispatch.py`` sends each token's choices to their experts and combines the
results, ``hugging_face.py`` finds a Hugging Face model's experts modules and splits
them, ``sharding.py`` shards the experts with FSDP2 over the ranks that hold the same
experts (docs/expert-parallel.md).
"""

from __future__ import annotations

from torch import nn

from modelparallel.config import ConfigError
from modelparallel.context import ParallelContext
from modelparallel.module_state import lookup

LOAD_BALANCING = ("aux_loss", "sinkhorn", "balanced", "none")
BUILT_LOAD_BALANCING = ("none",)


def apply(model: nn.Module, ctx: ParallelContext, load_balancing: str = "none") -> nn.Module:
    """Split ``model``'s experts over this rank's expert-parallel group (nothing to do with
    ``expert_parallel_degree`` 1). ``load_balancing`` is SMP's ``moe_load_balancing``:
    only ``"none"`` (the router as the model has it, no balancing loss) is built."""
    if load_balancing not in LOAD_BALANCING:
        raise ValueError(f"moe_load_balancing={load_balancing!r}; SMP accepts "
                         f"{', '.join(map(repr, LOAD_BALANCING))}")
    if load_balancing not in BUILT_LOAD_BALANCING:
        raise NotImplementedError(
            f"moe_load_balancing={load_balancing!r} is not built yet; use "
            f"moe_load_balancing='none' (the model's own router, no balancing loss)")
    if ctx.ep_group is None:
        return model
    from modelparallel.parallel.expert_parallel import hugging_face

    _refuse_router_loss(model)
    return hugging_face.install(model, ctx.ep_group, ctx.topology.ep_rank(ctx.rank),
                                ctx.meshes["experts"])


def _refuse_router_loss(model: nn.Module) -> None:
    """A model that adds its own load-balancing loss computes it from this rank's tokens
    only: refused until ``aux_loss`` is built (its statistics all-reduced)."""
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        raise ConfigError([("expert_parallel_degree", (
            "the model adds its router's load-balancing loss (config.output_router_logits="
            "True), computed from this rank's tokens only under expert parallelism; set "
            "output_router_logits=False (moe_load_balancing='aux_loss' is not built yet)"))])


def split_experts(model: nn.Module) -> list[nn.Module]:
    """The experts modules :func:`apply` split in ``model`` (none if it split none)."""
    found = lookup(model, "expert_parallel")
    return list(found) if isinstance(found, list) else []


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model``'s split experts: each rank holds its own experts'."""
    return [p for module in split_experts(model) for p in module.parameters()]


def require_split(model: nn.Module, ctx: ParallelContext, call: str) -> None:
    """Refuse what ``expert_parallel_degree`` > 1 would train wrong or not as asked: a model
    ``tsm.transform`` did not split, and wrappers other than ``mp.shard`` (whose gradient
    averaging over the ranks holding each expert is not built)."""
    if ctx.topology.ep == 1:
        return
    if call != "mp.shard()":
        raise ConfigError([("expert_parallel_degree", (
            f"{ctx.topology.ep} with {call} is not built yet (the experts' gradients are "
            f"averaged over the ranks holding them by mp.shard only); wrap the model with "
            f"mp.shard(), or set expert_parallel_degree to 1"))])
    if not split_experts(model):
        raise ConfigError([("expert_parallel_degree", (
            f"{ctx.topology.ep}, but the model given to {call} was not split over the "
            f"expert-parallel ranks: call tsm.transform(model, config=MoEConfig("
            f"smp_moe=False, moe_load_balancing='none')) first (as SMP v2 requires), or "
            f"set expert_parallel_degree to 1"))])
