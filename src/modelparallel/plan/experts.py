"""Mixture-of-experts layers under the planner: the routing it assumes.

How many rows each expert computes depends on the router's choices, which a simulation
on fake tensors does not have. Two places depend on them:

- transformers 5's experts modules (``experts_implementation`` ``grouped_mm``, its
  default, and ``batched_mm``) compute every (token, k) choice in tensors of
  ``tokens x top_k`` rows whatever the routing: they run as they are (``grouped_mm``'s
  shapes: ``fake_world.GroupedMatmulShapes``). Their ``eager`` loop over the experts the
  router chose has shapes that depend on the choices: refused (``refuse_routing_loops``).
- Expert parallelism's dispatch (``parallel/expert_parallel/dispatch.py``) sends each
  rank the rows its experts were chosen for: how many, it reads from the exchanged
  counts through ``ExpertParallelExperts.counts``, which the planner replaces by the
  counts of an assumed routing (``assume_routing``). Everything else the dispatch and
  the experts allocate is the library's and the model's own code, run as in training.

The assumed routings (docs/planner.md, "Mixtures of experts"):

- ``worst``: every token of the expert-parallel group chooses this rank's experts for
  as many of its ``top_k`` choices as the rank holds experts (a token's choices are
  distinct experts): ``tokens x min(top_k, E / ep)`` rows from each of the ``ep`` ranks,
  its own included; its other choices go to the other ranks evenly. No routing makes a
  rank receive more, so the peak planned with it bounds a run's.
- ``balanced``: every expert receives ``tokens x top_k / E`` rows from each rank, the
  expected traffic of a balanced router.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from modelparallel.module_state import lookup
from modelparallel.parallel.expert_parallel import split_experts
from modelparallel.parallel.expert_parallel.hugging_face import find_experts
from modelparallel.parallel.expert_parallel.ownership import ExpertRange
from modelparallel.plan.fake_world import PlanError

ROUTINGS = ("worst", "balanced")
# transformers' experts implementations whose shapes do not depend on the routing
ROUTING_FREE = ("grouped_mm", "batched_mm")


def refuse_routing_loops(model: nn.Module) -> None:
    """PlanError for an experts module whose computation's shapes follow the router's
    choices (transformers' ``eager`` loop over the experts chosen)."""
    for name, module in find_experts(model):
        config = getattr(module, "config", None)
        implementation = getattr(config, "_experts_implementation", None)
        if implementation is not None and implementation not in ROUTING_FREE:
            raise PlanError(
                f"{name} computes with experts_implementation={implementation!r}, a loop "
                f"over the experts the router chose, whose shapes the planner cannot know "
                f"without running it; plan (and train) the model built with "
                f"experts_implementation='grouped_mm' (transformers' default) or "
                f"'batched_mm', whose shapes do not depend on the routing")


def assume_routing(model: nn.Module, routing: str) -> int:
    """Make every experts module expert parallelism split in ``model`` route as
    ``routing`` assumes (one of ``ROUTINGS``); the number of modules."""
    if routing not in ROUTINGS:
        raise PlanError(f"routing {routing!r}: choose one of {', '.join(ROUTINGS)}")
    modules = split_experts(model)
    for module in modules:
        share = lookup(module, "expert_parallel")
        ep = dist.get_world_size(share.group)
        share.counts = functools.partial(routed_counts, routing, share.experts, ep)
    return len(modules)


def routed_counts(routing: str, experts: ExpertRange, ep: int, top_k_index: torch.Tensor,
                  send: torch.Tensor, receive: torch.Tensor) -> tuple[list[int], list[int]]:
    """The rows this rank sends to each rank of its group and receives from each under
    ``routing``, for ``top_k_index``'s tokens x top_k choices (every rank has as many);
    ``send`` and ``receive``, the exchanged counts, have no values here."""
    tokens, top_k = top_k_index.shape
    choices = tokens * top_k
    here = experts.first // experts.count  # this rank's index in its group
    if routing == "balanced":
        even = spread(choices, ep)
        return even, [even[here]] * ep
    mine = tokens * min(top_k, experts.count)
    others = iter(spread(choices - mine, ep - 1))
    sent = [mine if r == here else next(others) for r in range(ep)]
    return sent, [mine] * ep


def spread(rows: int, parts: int) -> list[int]:
    """``rows`` split into ``parts`` as evenly as whole rows go, the larger parts first."""
    if parts == 0:
        return []
    share, extra = divmod(rows, parts)
    return [share + (r < extra) for r in range(parts)]
