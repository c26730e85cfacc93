"""Exact causal attention over a sequence split across the context-parallel ranks.

Each rank holds its queries, keys and values for its two chunks (``split.py``). The
keys and values of every rank must meet every rank's queries; SMP's two ways
(``cp_comm_type``):

- ``"p2p"``: a ring. At each of ``cp`` steps a rank computes against the key/value
  block it holds while it already sends that block on to the next rank and receives
  the next from the previous one (communication overlaps computation). In the
  backward the blocks go round again, each with the gradient of its keys and values,
  which every rank adds to on the way; one last hop brings that gradient home.
- ``"all_gather"``: every rank gathers all blocks at once (one collective, no
  overlap); the backward sends each block's gradient to its owner with one
  all-to-all and sums.

Partial results are merged with their log-sum-exp (``blocks.py``), so the result is
the softmax over the whole sequence. Attention dropout masks are functions of global
positions (``dropout.py``): the backward draws the forward's again, at any degree.
Keys and values travel in the model's dtype (bf16 stays bf16), gradients in the working
dtype (float32 at least). Only the local keys and values are kept for the backward:
the blocks are exchanged again there.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from modelparallel.parallel.context_parallel import blocks
from modelparallel.parallel.context_parallel.dropout import (
    AttentionDropout,
    Masks,
    draw_seed,
    positional_masks,
)
from modelparallel.parallel.context_parallel.split import chunks_of

COMM_TYPES = ("p2p", "all_gather")
_KV_TAG, _GRAD_TAG = 11, 12  # distinct tags: both exchanges may be in flight at once


class _RingHop:
    """One asynchronous hop of a tensor to the next rank of the ring, and the matching
    receive from the previous rank."""

    def __init__(self, tensor: torch.Tensor, group: dist.ProcessGroup, tag: int):
        me, size = dist.get_rank(group), dist.get_world_size(group)
        self.received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (me + 1) % size),
                          group, tag),
               dist.P2POp(dist.irecv, self.received,
                          dist.get_global_rank(group, (me - 1) % size), group, tag)]
        self._works = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        return self.received


def _work_dtype(q: torch.Tensor) -> torch.dtype:
    """Scores and sums in float32 at least (float64 stays float64)."""
    return torch.promote_types(q.dtype, torch.float32)


def _gather_blocks(kv: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    pieces = [torch.empty_like(kv) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, kv, group=group)
    return pieces


def _scatter_grads(grads: list[torch.Tensor], group: dist.ProcessGroup) -> torch.Tensor:
    """Each rank's gradient for rank r's block summed on rank r (a reduce-scatter, made of
    an all-to-all, which gloo has)."""
    sent = torch.stack(grads)
    got = torch.empty_like(sent)
    dist.all_to_all_single(got, sent, group=group)
    return got.sum(0)


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's chunks against the whole sequence."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                group: dist.ProcessGroup, comm_type: str, scale: float,
                dropout: AttentionDropout | None) -> torch.Tensor:
        me, size = dist.get_rank(group), dist.get_world_size(group)
        mine = chunks_of(me, size)
        work = _work_dtype(q)
        qf = q.to(work)
        kv = torch.stack([k, v]).contiguous()  # sent in the model's dtype
        out = lse = None
        for source, block in _blocks(kv, group, comm_type):
            b_out, b_lse = blocks.attend(qf, block[0], block[1], mine,
                                         chunks_of(source, size), scale, dropout)
            if out is None or lse is None:  # the first block is the rank's own
                out, lse = b_out, b_lse
            else:
                out, lse = blocks.merge(out, lse, b_out, b_lse)
        assert out is not None and lse is not None
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.comm_type, ctx.scale, ctx.dropout = group, comm_type, scale, dropout
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        me, size = dist.get_rank(group), dist.get_world_size(group)
        mine = chunks_of(me, size)
        work = _work_dtype(q)
        qf, doutf = q.to(work), dout.to(work)
        delta = (doutf * out).sum(-1)
        kv = torch.stack([k, v]).contiguous()
        dq = torch.zeros_like(qf)

        def grads_of(source: int, block: torch.Tensor) -> torch.Tensor:
            b_dq, b_dk, b_dv = blocks.attend_backward(
                qf, block[0], block[1], mine, chunks_of(source, size), scale, lse, doutf,
                delta, ctx.dropout)
            dq.add_(b_dq)
            return torch.stack([b_dk, b_dv])

        if ctx.comm_type == "all_gather":
            pieces = _gather_blocks(kv, group)
            dkv = _scatter_grads([grads_of(s, b) for s, b in enumerate(pieces)], group)
        else:
            dkv = _ring_backward(kv, group, grads_of)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _blocks(kv: torch.Tensor, group: dist.ProcessGroup, comm_type: str):
    """(source rank, its stacked keys and values), the rank's own block first."""
    me, size = dist.get_rank(group), dist.get_world_size(group)
    if comm_type == "all_gather":
        pieces = _gather_blocks(kv, group)
        for step in range(size):
            source = (me - step) % size
            yield source, pieces[source]
        return
    block = kv
    for step in range(size):
        hop = _RingHop(block, group, _KV_TAG) if step < size - 1 else None
        yield (me - step) % size, block  # computed on while the hop is in flight
        if hop is not None:
            block = hop.wait()


def _ring_backward(kv: torch.Tensor, group: dist.ProcessGroup, grads_of) -> torch.Tensor:
    """The ring backward: each block travels with its gradient; after the last step one
    more hop brings every block's complete gradient to its owner."""
    me, size = dist.get_rank(group), dist.get_world_size(group)
    if size == 1:  # the only block is the rank's own: no hop (gloo cannot send to itself)
        return grads_of(me, kv)
    block, grad_hop = kv, None
    for step in range(size):
        kv_hop = _RingHop(block, group, _KV_TAG) if step < size - 1 else None
        grad = grads_of((me - step) % size, block)
        if grad_hop is not None:  # what the ranks before added to this block's gradient
            grad = grad + grad_hop.wait()
        grad_hop = _RingHop(grad, group, _GRAD_TAG)
        if kv_hop is not None:
            block = kv_hop.wait()
    assert grad_hop is not None
    return grad_hop.wait()


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup, comm_type: str = "p2p",
                   scale: float | None = None, dropout: float = 0.0,
                   masks: Masks | None = None) -> torch.Tensor:
    """Causal attention of this rank's local queries (B, H, L, D) against the keys and
    values (B, Hkv, L, D) of every rank of ``group`` (collective over it); returns
    (B, H, L, D) in ``q``'s dtype. ``L`` is the rank's two chunks (``split.py``).

    ``dropout``: the probability of dropping an attention weight; which are dropped is
    ``masks`` (of global query and key positions), by default
    ``dropout.positional_masks`` of a seed drawn now from the live generator."""
    if comm_type not in COMM_TYPES:
        raise ValueError(f"cp_comm_type={comm_type!r}; use 'p2p' or 'all_gather'")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} "
                         "key/value heads")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"attention dropout {dropout}: a probability in [0, 1) is needed")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    drop = None
    if dropout > 0.0:
        if masks is None:
            masks = positional_masks(draw_seed(q.device), dropout, q.shape[0], q.shape[1])
        drop = AttentionDropout(dropout, masks)
    out: torch.Tensor = RingAttention.apply(q, k, v, group, comm_type, scale, drop)
    return out
