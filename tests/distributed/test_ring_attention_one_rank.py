"""Ring attention over a group of one rank (cp = 1, as on a single device) is the
causal attention of the whole sequence: its two chunks attend as one process does."""

from __future__ import annotations

import pytest
import torch


def one_rank_case(comm: str) -> float:
    """Largest difference of the output and the q/k/v gradients from unsplit sdpa."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from modelparallel.parallel.context_parallel.ring import ring_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g, dtype=torch.float64,
                           requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 4, 16, 8, generator=g, dtype=torch.float64)
    results = []
    for attention in (lambda: ring_attention(q, k, v, dist.group.WORLD, comm),
                      lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)):
        out = attention()
        out.backward(grad)
        results.append([out.detach(), q.grad, k.grad, v.grad])
        q.grad = k.grad = v.grad = None
    return max(float((a - b).abs().max()) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
def test_one_rank_ring_is_whole_sequence_attention(workers, comm):
    assert workers(1).run(one_rank_case, comm=comm)[0] < 1e-12
