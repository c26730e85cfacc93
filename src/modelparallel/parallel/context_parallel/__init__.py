"""Context parallelism: each sequence split over ``context_parallel_degree`` ranks.

``split.py`` is SMP's load-balanced split, ``blocks.py`` causal attention of one rank's
chunks against another's, ``ring.py`` the exact attention over the whole sequence (a
ring of key/value exchanges, or one all-gather), ``hugging_face.py`` what a Hugging
Face causal LM needs besides (positions, shifted labels, the loss's divisor).
"""

from __future__ import annotations

from torch import nn

from modelparallel.config import ConfigError
from modelparallel.context import ParallelContext
from modelparallel.module_state import lookup


def apply(model: nn.Module, ctx: ParallelContext, comm_type: str) -> nn.Module:
    """Split ``model``'s sequences over this rank's context-parallel group (nothing to do
    with ``context_parallel_degree`` 1)."""
    if ctx.cp_group is None:
        return model
    from modelparallel.parallel.context_parallel import hugging_face

    return hugging_face.install(model, ctx.cp_group, comm_type)


def require_split(model: nn.Module, ctx: ParallelContext, call: str) -> None:
    """Refuse to wrap a model that ``context_parallel_degree`` > 1 would train wrong: one
    not given to ``tsm.transform``, whose attention sees only this rank's chunks."""
    if ctx.topology.cp > 1 and lookup(model, "context_parallel") is None:
        raise ConfigError([("context_parallel_degree", (
            f"{ctx.topology.cp}, but the model given to {call} was not split over the "
            f"context-parallel ranks: call tsm.transform(model) first (as SMP v2 requires), "
            f"or set context_parallel_degree to 1"))])
