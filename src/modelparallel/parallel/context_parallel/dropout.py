"""Attention dropout under context parallelism: masks of global positions.

Ring attention never holds a rank's whole score matrix: it scores its queries against
one key block, one tile of rows at a time, and scores them again in the backward. A
dropout mask drawn from a generator in that order would depend on the tiles, the blocks'
order and the degree, and the backward would have to store it. Here a mask is a
function of where an element is - (sample row, head, global query position, global key
position) - and of one seed per call, drawn from the live generator (so the randomness
rules hold: tensor-parallel regions seed it per rank, and activation checkpointing
restores the generator before it recomputes). Any tile can be masked alone, the
backward recomputes the forward's masks, and a sequence draws the same masks at every
``context_parallel_degree`` and with either ``cp_comm_type``.

The hash is MurmurHash3's 32-bit finaliser, chained over the coordinates, computed
with int64 tensor ops that never overflow (so it runs alike on CPU and CUDA).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# keep(global query rows (R,), global key columns (C,)) -> bool (B, H, R, C)
Masks = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_LOW32 = 0xFFFFFFFF


@dataclass(frozen=True)
class AttentionDropout:
    """Dropout of attention weights with probability ``p``; ``keep`` says which
    elements stay (they are scaled by 1 / (1 - p))."""

    p: float
    keep: Masks

    def scale(self, rows: torch.Tensor, cols: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The factor of each weight: 0 where dropped, 1 / (1 - p) where kept."""
        return self.keep(rows, cols).to(dtype) * (1.0 / (1.0 - self.p))


def _times(h: torch.Tensor, constant: int) -> torch.Tensor:
    """``h * constant`` modulo 2**32 for ``h`` below 2**32, in 16-bit halves (no int64
    overflow)."""
    low = h * (constant & 0xFFFF)
    high = ((h * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _LOW32


def _mix(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser: a bijection of 32-bit values that spreads every bit."""
    h = h ^ (h >> 16)
    h = _times(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _times(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def positional_masks(seed: torch.Tensor, p: float, batch: int, heads: int) -> Masks:
    """Masks of (sample row, head, global query position, global key position) for
    ``seed`` (an int64 tensor below 2**32): an element is kept when its hash is at or
    above ``p`` (in steps of 2**-32)."""
    rows_and_heads = torch.arange(batch * heads, device=seed.device).view(batch, heads, 1)
    per_head = _mix(rows_and_heads ^ (seed.reshape(()) & _LOW32))
    threshold = round(p * 2**32)

    def keep(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        per_row = _mix(per_head ^ rows.to(per_head.device))  # (B, H, R)
        return _mix(per_row.unsqueeze(-1) ^ cols.to(per_head.device)) >= threshold

    return keep


def draw_seed(device: torch.device) -> torch.Tensor:
    """One call's seed from the live generator of ``device`` (as a dropout would draw)."""
    return torch.randint(0, 2**32, (), dtype=torch.int64, device=device)
