"""The masks of context-parallel attention dropout: they keep 1 - p of the weights,
independently of each other, are functions of positions only (any tile, any order, any
degree), differ between seeds, sample rows and heads, and come from the live generator
(so seeding it, and activation checkpointing's restoring it, selects them)."""

from __future__ import annotations

import math

import torch

from modelparallel.parallel.context_parallel.dropout import draw_seed, positional_masks

B, H, N = 2, 4, 128


def full(masks) -> torch.Tensor:
    every = torch.arange(N)
    return masks(every, every)


def test_masks_keep_one_minus_p_of_the_weights():
    for p in (0.1, 0.5, 0.9):
        keep = full(positional_masks(torch.tensor(7), p, B, H)).double()
        count = keep.numel()
        sigma = math.sqrt(p * (1 - p) / count)
        assert abs(keep.mean().item() - (1 - p)) < 5 * sigma, (p, keep.mean().item())


def test_masks_are_independent_of_neighbours_rows_heads_and_samples():
    """Two elements agree as often as two independent draws do: (1-p)^2 + p^2."""
    p = 0.3
    keep = full(positional_masks(torch.tensor(11), p, B, H)).double()
    expected = (1 - p) ** 2 + p**2
    pairs = {"next key": (keep[..., 1:], keep[..., :-1]),
             "next query": (keep[..., 1:, :], keep[..., :-1, :]),
             "next head": (keep[:, 1:], keep[:, :-1]),
             "next sample": (keep[1:], keep[:-1]),
             "transposed": (keep, keep.transpose(-2, -1))}
    for name, (a, b) in pairs.items():
        agree = (a == b).double().mean().item()
        sigma = math.sqrt(expected * (1 - expected) / a.numel())
        assert abs(agree - expected) < 6 * sigma, (name, agree, expected)


def test_a_tile_of_positions_draws_what_the_whole_draws():
    masks = positional_masks(torch.tensor(3), 0.2, B, H)
    whole = full(masks)
    rows, cols = torch.tensor([5, 90, 17]), torch.arange(64, 100)
    assert torch.equal(masks(rows, cols), whole[:, :, rows][..., cols])


def test_seeds_select_the_masks_and_the_live_generator_draws_the_seed():
    one = full(positional_masks(torch.tensor(1), 0.5, B, H))
    other = full(positional_masks(torch.tensor(2), 0.5, B, H))
    assert 0.4 < (one == other).double().mean().item() < 0.6
    torch.manual_seed(0)
    first = draw_seed(torch.device("cpu"))
    torch.manual_seed(0)
    assert draw_seed(torch.device("cpu")) == first  # a restored generator draws it again
    assert draw_seed(torch.device("cpu")) != first
    assert 0 <= int(first) < 2**32


def test_the_hash_never_leaves_32_bits():
    """The int64 arithmetic must not overflow (it would differ between CPU and CUDA)."""
    from modelparallel.parallel.context_parallel.dropout import _mix

    top = torch.tensor([2**32 - 1, 2**31, 0, 1, 0x85EBCA6B], dtype=torch.int64)
    out = _mix(top)
    assert bool(((out >= 0) & (out < 2**32)).all())
    # MurmurHash3's finaliser of 1 and 2**32 - 1 (values computed with Python integers)
    assert out[3].item() == _reference_mix(1) and out[0].item() == _reference_mix(2**32 - 1)


def _reference_mix(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) % 2**32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) % 2**32
    return h ^ (h >> 16)
