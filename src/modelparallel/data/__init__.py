"""Data loading keyed by the data-parallel rank: one model replica, one stream of samples
(``mp.data``), and data that ships with Python for the examples (``datasets``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.utils.data as tud

from modelparallel.smp.state import state
from modelparallel.topology import CommGroup


class BatchSizeError(ValueError):
    """A batch that cannot be split into ``microbatches`` equal pieces."""


def replica_rank_and_size() -> tuple[int, int]:
    """Which slice of the data this rank reads, and how many slices there are.

    As SMP v1: ``(dp_rank, dp_size)``, so the pipeline stages of one replica read the
    same samples; with ``prescaled_batch`` the ranks of a tensor-parallel group read
    the same samples too, ``(rdp_rank, rdp_size)``. The ranks of a context-parallel
    group read the same samples (each computes its part of every sequence).
    """
    s = state.require("mp.data").context
    group = CommGroup.RDP_GROUP if s.config.prescaled_batch else CommGroup.DP_GROUP
    return s.topology.reading_rank(s.rank, group)


def check_microbatches(batch_size: int, microbatches: int, *, where: str = "the batch") -> None:
    """Raise a BatchSizeError when ``batch_size`` does not split into ``microbatches``."""
    if batch_size % microbatches:
        lower = batch_size // microbatches * microbatches
        upper = lower + microbatches
        options = f"{lower} or {upper}" if lower else f"{upper}"
        raise BatchSizeError(
            f"{where} has {batch_size} samples, which does not split into microbatches="
            f"{microbatches} equal parts; use a batch size that is a multiple of "
            f"{microbatches} (e.g. {options}), or drop_last=True so that every batch is full")


class DistributedSampler(tud.DistributedSampler):
    """``torch.utils.data.DistributedSampler`` over the data-parallel replicas.

    Every rank of one model replica gets the same indices; shuffling is seeded
    (same permutation on every rank; call ``set_epoch`` each epoch). ``skip`` drops
    that many indices from the start of the next pass (resuming mid-epoch).
    """

    def __init__(self, dataset: tud.Dataset, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False):
        rank, replicas = replica_rank_and_size()
        super().__init__(dataset, num_replicas=replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        skip, self.skip = self.skip, 0
        return iter(indices[skip:])


class DataLoader(tud.DataLoader):
    """A ``torch.utils.data.DataLoader`` reading this rank's share of ``dataset``.

    ``batch_size`` is per model replica. Checks up front that every batch splits into
    the configured ``microbatches`` (the last, partial one too unless ``drop_last``).
    Its position (epoch and batches taken) is part of a checkpoint: pass it as
    ``mp.save_checkpoint(..., data_loader=loader)`` and the resumed run goes on with
    the next batch.
    """

    def __init__(self, dataset: tud.Dataset, batch_size: int, *, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, **kwargs: Any):
        microbatches = state.require("mp.data.DataLoader").context.config.microbatches
        check_microbatches(batch_size, microbatches, where=f"batch_size={batch_size}")
        sampler = DistributedSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)
        last = len(sampler) % batch_size
        if last and not drop_last:
            check_microbatches(last, microbatches, where=f"the last batch of each epoch "
                               f"({len(sampler)} samples per replica, batch_size={batch_size})")
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                         **kwargs)
        self.epoch = 0
        self.batches_taken = 0  # in this epoch

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for a new epoch (same order on every rank)."""
        if epoch != self.epoch:
            self.batches_taken = 0
        self.epoch = epoch
        self.sampler.set_epoch(epoch)  # type: ignore[attr-defined]  # our sampler

    def __iter__(self):
        self.sampler.skip = self.batches_taken * self.batch_size
        for batch in super().__iter__():
            self.batches_taken += 1
            yield batch
        self.batches_taken = 0  # a finished pass starts the next from the top

    def state_dict(self) -> dict[str, int]:
        """Where this loader is: its epoch and the batches taken in it."""
        return {"epoch": self.epoch, "batches_taken": self.batches_taken}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Go on from a saved position: the next pass starts after the batches taken."""
        self.set_epoch(state_dict["epoch"])
        self.batches_taken = state_dict["batches_taken"]
