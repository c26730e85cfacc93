"""Ring attention (both exchanges) against unsplit causal attention, in float64: the
output and the gradients of queries, keys and values on every rank, with grouped-query
attention, at 2 and 4 ranks, with and without attention dropout (the unsplit attention
drops the weights the masks of global positions name)."""

from __future__ import annotations

import pytest
import torch


def unsplit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            dropout: float = 0.0, masks=None) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ k.transpose(-2, -1) * scale
    n = q.shape[-2]
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    weights = s.softmax(-1)
    if dropout:
        everywhere = torch.arange(n)
        weights = weights * masks(everywhere, everywhere) / (1 - dropout)
    return weights @ v


def ring_case(comm: str, tile: int, dropout: float) -> float:
    """The largest difference from unsplit attention on this rank (query rows scored
    ``tile`` at a time: 3 makes several tiles per chunk, the last one short)."""
    import torch.distributed as dist

    from modelparallel.parallel.context_parallel import blocks, split
    from modelparallel.parallel.context_parallel.dropout import positional_masks
    from modelparallel.parallel.context_parallel.ring import ring_attention

    blocks.ROW_TILE, default_tile = tile, blocks.ROW_TILE

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    b, heads, kv_heads, n, d = 2, 4, 2, 8 * world, 16
    q = torch.randn(b, heads, n, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, kv_heads, n, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, kv_heads, n, d, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(b, heads, n, d, dtype=torch.float64)
    masks = positional_masks(torch.tensor(20261129), dropout, b, heads)
    expected = unsplit(q, k, v, 0.3, dropout, masks)
    (expected * weights).sum().backward()

    def mine(t: torch.Tensor) -> torch.Tensor:
        return split.split(t, rank, world, dim=2)

    local = [mine(t.detach()).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, dist.group.WORLD, comm, 0.3, dropout, masks)
    (out * mine(weights)).sum().backward()
    errors = [(out - mine(expected)).abs().max()]
    errors += [(t.grad - mine(full.grad)).abs().max()
               for t, full in zip(local, (q, k, v), strict=True)]
    blocks.ROW_TILE = default_tile
    return float(max(errors))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
@pytest.mark.parametrize("tile", [pytest.param(256, marks=pytest.mark.extended), 3])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_ring_attention_is_unsplit_causal_attention(workers, world, comm, tile, dropout):
    for rank, error in enumerate(workers(world).run(ring_case, comm=comm, tile=tile,
                                                    dropout=dropout)):
        assert error < 1e-12, (rank, error)
