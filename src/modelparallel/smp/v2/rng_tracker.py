"""``tsm.state.get_rng_state_tracker()``: Megatron's tracker of named random states.

Activation checkpointing of a tensor-parallel layer (Transformer Engine's and Megatron's
``checkpoint(..., get_rng_state_tracker=...)``) saves the tracker's states before the
forward and restores them before the recomputation, so dropout inside ``fork()``
replays the same masks. The default state, ``model-parallel-rng``, is seeded with
``random_seed`` plus the tensor-parallel rank: each rank of a group draws its own masks
for its split activations, as SMP v2 seeds them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

DEFAULT_NAME = "model-parallel-rng"


class RNGStateTracker:
    """Named CPU (and CUDA) generator states, entered with :meth:`fork`."""

    def __init__(self) -> None:
        self.states: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def reset(self) -> None:
        self.states = {}

    def get_states(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        return dict(self.states)

    def set_states(self, states: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        self.states = dict(states)

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"random state {name!r} already exists")
        saved = _current()
        torch.manual_seed(seed)
        self.states[name] = _current()
        _restore(saved)

    @contextlib.contextmanager
    def fork(self, name: str = DEFAULT_NAME) -> Iterator[None]:
        """Draw from the state ``name`` inside the block, then put the caller's back."""
        if name not in self.states:
            raise KeyError(f"random state {name!r} was never added; known: "
                           f"{sorted(self.states)}")
        saved = _current()
        _restore(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _current()
            _restore(saved)


def _current() -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda


def _restore(states: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1])
