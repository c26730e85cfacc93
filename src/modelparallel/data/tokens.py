"""``mp.global_token_count``: the divisor of a token-sum loss that trains as one process.

The facade's part: which labels make up the step (inside an ``@mp.step`` function,
every microbatch's), how many places SMP v1's step splits a batch into, and the
current context. The arithmetic and the collective are the core's
(``parallel/token_count.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from modelparallel.parallel import token_count
from modelparallel.parallel.pipeline.runtime import running_microbatch
from modelparallel.smp import registry
from modelparallel.smp.state import state


class StepLabelsError(ValueError):
    """Inside an ``@mp.step`` function, a tensor that is not one of the step's arguments."""


class _Step:
    """The tensors of every microbatch of the running step, by position, and the counts
    taken so far (one collective per step and kind of count)."""

    def __init__(self, pieces: list[tuple[tuple, dict]]):
        self.tensors = [list(_tensors(piece)) for piece in pieces]
        self.counts: dict[tuple[int, int, bool, bool], torch.Tensor] = {}

    def position(self, labels: torch.Tensor) -> int | None:
        for tensors in self.tensors:
            for i, t in enumerate(tensors):
                if t is labels:
                    return i
        return None


_step: _Step | None = None  # greenlets share it: they run one at a time, in one thread


@contextmanager
def counting_step(pieces: list[tuple[tuple, dict]]) -> Iterator[None]:
    """Around one ``@mp.step`` call: its microbatches' ``(args, kwargs)``."""
    global _step
    outer, _step = _step, _Step(pieces)
    try:
        yield
    finally:
        _step = outer


def global_token_count(labels: torch.Tensor, ignore_index: int = token_count.IGNORE_INDEX,
                       *, shift: bool = False, count: bool = False) -> torch.Tensor:
    """The divisor that makes ``loss_sum / mp.global_token_count(labels)`` train exactly
    as one process trains ``loss_sum_of_whole_batch / C``.

    ``C`` is the number of valid targets (``labels != ignore_index``) in the step's
    global batch: every data-parallel rank's labels (a tensor-parallel group's batch
    once with ``prescaled_batch``). Each loss gradient is averaged over ``K`` places
    (data-parallel batches, a tensor-parallel group's own rows, SMP v1 microbatches),
    so the divisor is ``C / K``: a 0-dim float tensor on this rank's device, the same
    on every rank. ``count=True`` returns ``C`` (0-dim int64). ``shift=True`` counts
    ``labels[..., 1:]``, the targets of a loss that shifts the labels itself (Hugging
    Face's causal LMs: pass the result as ``num_items_in_batch=``).

    Pass this rank's labels of the step. Inside an ``@mp.step`` function pass the
    microbatch's labels as the function received them: the whole step is counted (once,
    on the first call). Outside one, with an ``mp.DistributedModel``, pass the step's
    labels; the divisor is then for ``@mp.step`` (pass it as an argument). Collective
    over the data-parallel group: on a pipeline, after the model call only the last
    stage runs the step function, and its data-parallel group is that stage's ranks.
    """
    ctx = state.require("mp.global_token_count").context
    mb = running_microbatch()
    if mb is None or _step is None:
        microbatches = ctx.config.microbatches if registry.model() is not None else 1
        if shift and ctx.topology.cp > 1:  # this rank holds chunks: shift on the whole
            local = token_count.valid_targets_of_chunks(
                labels, ignore_index, holds_start=ctx.topology.cp_rank(ctx.rank) == 0)
        else:
            local = token_count.valid_targets(labels, ignore_index, shift=shift)
        return token_count.reduce_count(local, ctx, microbatches=microbatches, count=count)
    step = _step
    position = step.position(labels) if isinstance(labels, torch.Tensor) else None
    if position is None:
        raise StepLabelsError(
            "inside an @mp.step function mp.global_token_count counts the whole step, so "
            "it needs a tensor argument of the step function as received (use shift=True, "
            "not labels[..., 1:]); or count the step's labels before calling the step "
            "function and pass the divisor as an argument")
    key = (position, ignore_index, shift, count)
    if key not in step.counts:
        local = torch.stack([token_count.valid_targets(tensors[position], ignore_index,
                                                       shift=shift)
                             for tensors in step.tensors]).sum()
        step.counts[key] = token_count.reduce_count(local, ctx, microbatches=len(step.tensors),
                                                    count=count)
    return step.counts[key]


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors of a step's arguments, in a fixed order, as ``@mp.step`` splits them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _tensors(value)
