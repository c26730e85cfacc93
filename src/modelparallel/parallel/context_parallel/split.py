"""SMP's load-balanced split of a sequence over the context-parallel ranks, and its inverse.

A sequence of length ``S`` is cut into ``2 * cp`` equal chunks; rank ``r`` holds chunks
``r`` and ``2 * cp - 1 - r`` (one early, one late), so that under causal attention every
rank does the same work. This is the split of SMP v2's shared-scripts
(``get_batch_for_cp_rank``) and of NeMo / Transformer Engine. A rank's local sequence is
its two chunks concatenated; the library never guesses whether an input is a chunk: a
model transformed with ``context_parallel_degree`` > 1 takes this rank's chunks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def chunks_of(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The indices (of ``2 * cp_size``) of the two chunks rank ``cp_rank`` holds."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def check_local_length(length: int, cp_size: int) -> None:
    """A local sequence is two equal chunks: its length must be even."""
    if length % 2:
        raise ValueError(
            f"a context-parallel rank's sequence has {length} positions, but it holds two "
            f"equal chunks of the whole sequence: the whole sequence must be a multiple of "
            f"2 x context_parallel_degree = {2 * cp_size} (pad it, or use mp.split_for_context_"
            f"parallel on whole sequences of such a length)")


def positions(cp_rank: int, cp_size: int, local_length: int,
              device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions (0-based, int64) of the ``local_length`` tokens rank
    ``cp_rank`` holds, in the order it holds them."""
    check_local_length(local_length, cp_size)
    chunk = local_length // 2
    first, second = chunks_of(cp_rank, cp_size)
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


def split(tensor: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of a whole sequence along ``dim`` (SMP's split)."""
    length = tensor.shape[dim]
    if length % (2 * cp_size):
        raise ValueError(
            f"a sequence of {length} positions (dim {dim} of a tensor of shape "
            f"{tuple(tensor.shape)}) does not split into 2 x context_parallel_degree = "
            f"{2 * cp_size} equal chunks; pad it to a multiple of {2 * cp_size}")
    chunk = length // (2 * cp_size)
    first, second = chunks_of(cp_rank, cp_size)
    return torch.cat([tensor.narrow(dim, first * chunk, chunk),
                      tensor.narrow(dim, second * chunk, chunk)], dim=dim)


def unsplit(pieces: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's local sequence (``pieces[r]`` is rank ``r``'s)."""
    cp_size = len(pieces)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for rank, piece in enumerate(pieces):
        half = piece.shape[dim] // 2
        first, second = chunks_of(rank, cp_size)
        chunks[first] = piece.narrow(dim, 0, half)
        chunks[second] = piece.narrow(dim, half, half)
    return torch.cat([c for c in chunks if c is not None], dim=dim)


def gather_whole(local: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """The whole sequence on every rank of ``group`` from each rank's local sequence
    (collective; no gradient flows back: for labels and other integer inputs)."""
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return unsplit(pieces, dim)
