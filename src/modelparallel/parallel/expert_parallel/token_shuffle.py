"""``MoEConfig(global_token_shuffle=True)``: the tokens of an expert-parallel group
permuted across its ranks before SMP's MoE layer routes them, and brought back after.

The group's tokens, in rank order (rank 0's tokens, then rank 1's, ...), are permuted by
``torch.randperm(T, generator=torch.Generator().manual_seed(seed))`` (``T`` the group's
tokens, ``seed`` drawn from the first rank's torch CPU generator); position ``p`` of the
permuted sequence holds token ``permutation[p]``. Rank ``j`` of the ``n`` routes the
positions from ``share_bounds(T, n)[j]`` to ``[j + 1]``, an even share (``T // n``, the
first ``T % n`` ranks one more), in position order, and its outputs travel back to the tokens' own
ranks in their original order. Every rank draws a seed (so that their generators
advance alike) and uses the first rank's: torch's activation checkpointing restores the
CPU generator before it recomputes a forward, so the recomputation draws the same
permutation however many forwards ran in between.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from modelparallel.parallel.expert_parallel.exchange import all_to_all

_SEED_BOUND = 2**62  # the seed's range: any int64 the generator takes


def share_bounds(tokens: int, ranks: int) -> list[int]:
    """Where each rank's share of ``tokens`` permuted positions starts, and the end:
    ``ranks + 1`` bounds, shares of ``tokens // ranks``, the first ``tokens % ranks``
    one more."""
    share, extra = divmod(tokens, ranks)
    return [j * share + min(j, extra) for j in range(ranks + 1)]


def permutation(tokens: int, seed: int) -> torch.Tensor:
    """The group's permutation: position ``p`` holds the group's token ``result[p]``."""
    return torch.randperm(tokens, generator=torch.Generator().manual_seed(seed))


@dataclass(frozen=True)
class ShufflePlan:
    """Which rows this rank sends where and how they come back (the orders on the rows'
    device)."""

    send_order: torch.Tensor  # this rank's tokens in the order they leave
    send_counts: list[int]  # to each rank
    receive_counts: list[int]  # from each rank
    receive_order: torch.Tensor  # the share position of each received row
    group: dist.ProcessGroup

    def shuffle(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's share of the permuted tokens, in position order, from this
        rank's own ``rows`` (tokens, hidden). Differentiable."""
        received = all_to_all(rows[self.send_order], self.send_counts, self.receive_counts,
                              self.group)
        return received[torch.argsort(self.receive_order)]

    def unshuffle(self, share: torch.Tensor) -> torch.Tensor:
        """The rows computed for this rank's share, back on their tokens' own ranks in
        their original order. Differentiable."""
        returned = all_to_all(share[self.receive_order], self.receive_counts,
                              self.send_counts, self.group)
        return returned[torch.argsort(self.send_order)]


def plan(tokens: int, group: dist.ProcessGroup, device: torch.device) -> ShufflePlan:
    """The shuffle of this rank's ``tokens`` over ``group``: one small all-gather of
    every rank's token count and seed, the rest computed alike on every rank."""
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    seed = int(torch.randint(_SEED_BOUND, (1,)))  # torch's CPU generator: see the module
    mine = torch.tensor([tokens, seed], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(ranks)]
    dist.all_gather(gathered, mine, group=group)
    counts = [int(g[0]) for g in gathered]
    order = permutation(sum(counts), int(gathered[0][1]))
    bounds = share_bounds(sum(counts), ranks)
    starts = [sum(counts[:r]) for r in range(ranks + 1)]
    position = torch.argsort(order)  # the position of each of the group's tokens
    destination = torch.bucketize(position, torch.tensor(bounds[1:]), right=True)
    # the rank each position's token comes from
    source = torch.bucketize(order, torch.tensor(starts[1:]), right=True)
    own = position[starts[me]:starts[me + 1]]
    send_order = torch.argsort(own)  # by position, hence by destination rank
    sources = source[bounds[me]:bounds[me + 1]]
    # rows arrive by source rank, each source's in position order
    arrival = torch.argsort(sources, stable=True)
    return ShufflePlan(
        send_order.to(device),
        torch.bincount(destination[starts[me]:starts[me + 1]], minlength=ranks).tolist(),
        torch.bincount(sources, minlength=ranks).tolist(), arrival.to(device), group)
