"""``mp.split_for_context_parallel``: this rank's part of whole sequences (SMP's split).

A model transformed with ``context_parallel_degree`` > 1 takes this rank's chunks of
each sequence, never whole sequences (the library does not guess which it was given).
Scripts that hold whole sequences cut them with this helper, as SMP v2's shared-scripts
do with their own ``get_batch_for_cp_rank``: ``2 * cp`` chunks, rank ``r`` keeping
chunks ``r`` and ``2 * cp - 1 - r``.
"""

from __future__ import annotations

from typing import Any

import torch

from modelparallel.parallel.context_parallel import split
from modelparallel.smp.state import state


def split_for_context_parallel(*tensors: torch.Tensor | None, dim: int = 1) -> Any:
    """This rank's two chunks of each whole sequence along ``dim`` (1: ``(batch,
    sequence, ...)``); one tensor in, one tensor out; several in, a tuple out (``None``
    passes through). With ``context_parallel_degree`` 1 the tensors come back unchanged.
    The sequence length must be a multiple of ``2 * context_parallel_degree``."""
    ctx = state.require("mp.split_for_context_parallel").context
    topology = ctx.topology
    rank = topology.cp_rank(ctx.rank)
    out = tuple(t if t is None or topology.cp == 1 else split.split(t, rank, topology.cp, dim)
                for t in tensors)
    return out[0] if len(out) == 1 and out[0] is not None else out
