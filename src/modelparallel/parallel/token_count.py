"""The divisor of a token-sum loss that trains as one process does (``mp.global_token_count``).

One process trains a token-mean loss as ``loss_sum / C``: the summed per-token losses of
the whole step's batch over ``C``, its valid targets (labels other than
``ignore_index``). In parallel, each loss gradient is averaged over ``K`` places: the
data-parallel batches (``rdp``), the tensor-parallel ranks' own rows when a group
concatenates their batches (``prescaled_batch: False``: ``tp``), and SMP v1's
microbatches (``model.backward`` scales each by ``1 / microbatches``). A plain mean
per place therefore averages means, and differs from one process as soon as the
places hold different numbers of valid targets. Dividing each place's sum by ``C / K``
instead gives exactly ``grad(loss_sum_of_whole_batch) / C``.

With ``prescaled_batch: False`` the data-parallel group (``dp`` = ``rdp x tp``) holds
``dp`` distinct batches; with ``True`` its ``tp`` ranks hold the same batch, counted
``tp`` times. Either way the sum of the counts over the data-parallel group divided by
``dp`` is ``C / (places other than microbatches)``, so one all-reduce over the
data-parallel group serves both.

A loss the model computes itself on a tensor-parallel group's concatenated batch (a
Hugging Face model given ``labels=``) sums ``tp`` ranks' rows in one place: the batch
gathering (``tensor/batch.py``) multiplies a divisor it finds among the model's inputs
by the degree (``for_gathered_rows``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from modelparallel.context import ParallelContext
from modelparallel.topology import CommGroup

IGNORE_INDEX = -100  # torch's cross_entropy and Hugging Face's default

# the divisors this module made (weak: a divisor is dropped with its step)
_DIVISORS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def valid_targets(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX, *,
                  shift: bool = False) -> torch.Tensor:
    """How many entries of ``labels`` are targets (not ``ignore_index``), as a 0-dim int64.

    ``shift=True`` counts ``labels[..., 1:]``: a causal LM's loss that shifts the labels
    itself (Hugging Face's) never predicts the first position of a row.
    """
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"mp.global_token_count counts a tensor of labels, got "
                        f"{type(labels).__name__}: pass the labels tensor the loss reads")
    if labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"mp.global_token_count counts integer class labels, got a "
                        f"{labels.dtype} tensor: pass the labels (targets), not the logits")
    if shift:
        if labels.dim() == 0:
            raise ValueError("mp.global_token_count(shift=True) needs labels with a sequence "
                             "dimension (the last), got a 0-dim tensor")
        labels = labels[..., 1:]
    return (labels != ignore_index).sum(dtype=torch.int64)


def valid_targets_of_chunks(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX, *,
                            holds_start: bool) -> torch.Tensor:
    """The targets of a shifting causal-LM loss among a context-parallel rank's chunks
    of each sequence: every label but the first position of a whole sequence, which
    only the rank holding the sequences' start (``holds_start``: its first label) has."""
    count = valid_targets(labels, ignore_index)
    if holds_start and labels.dim() > 0 and labels.shape[-1]:
        count = count - (labels[..., 0] != ignore_index).sum(dtype=torch.int64)
    return count


def reduce_count(local: torch.Tensor, ctx: ParallelContext, *, microbatches: int = 1,
                 count: bool = False) -> torch.Tensor:
    """The divisor ``C / K`` from this rank's count ``local`` (of the whole step).

    Collective over the data-parallel group (every rank of it must call).
    ``microbatches`` is the number of places SMP v1's step splits this rank's batch
    into (1 elsewhere). ``count=True`` returns ``C`` itself (0-dim int64). The divisor
    is a 0-dim tensor of the default float type on ``ctx.device``.
    """
    if microbatches < 1:
        raise ValueError(f"microbatches must be at least 1, got {microbatches}")
    total = local.detach().to(device=ctx.device, dtype=torch.int64).reshape(())
    group = ctx.process_group(CommGroup.DP_GROUP)
    if dist.get_world_size(group) > 1:
        total = total.clone()
        dist.all_reduce(total, group=group)
    topology = ctx.topology
    if count:
        # prescaled: the tp ranks of a group counted the same batch
        return total // topology.tp if ctx.config.prescaled_batch else total
    divisor = total.to(torch.get_default_dtype()) / (topology.size_of(CommGroup.DP_GROUP)
                                                     * microbatches)
    _DIVISORS[divisor] = True
    return divisor


def is_divisor(value: object) -> bool:
    """Whether ``value`` is a divisor :func:`reduce_count` made."""
    return isinstance(value, torch.Tensor) and value in _DIVISORS


def for_gathered_rows(divisor: torch.Tensor, degree: int) -> torch.Tensor:
    """The divisor for a loss computed on ``degree`` ranks' batches in one place."""
    scaled = divisor * degree
    _DIVISORS[scaled] = True
    return scaled
