"""Random numbers under tensor parallelism (SMP v2's ``random_seed`` semantics).

Where activations are replicated over the TP ranks (after a row-parallel layer's
all-reduce) every rank must draw the same dropout mask, or the replicas drift apart:
that region uses the script's own global generator, seeded alike on every rank as
usual. Where activations are sharded (attention heads between the column- and the
row-parallel layer) each rank holds different units and must draw its own mask:
that region switches to a second stream seeded with ``random_seed`` plus the TP rank
(and the pipeline stage). Module hooks switch streams on entry and restore on exit,
so regions nest.
"""

from __future__ import annotations

import torch
from torch import nn

from modelparallel.parallel.tensor.plans import REPLICATED, SHARDED


class RNGStreams:
    """The replicated (global) and sharded generator states of this rank."""

    def __init__(self, seed: int, device: torch.device):
        self.device = device if device.type == "cuda" else None
        saved = self._get()
        torch.manual_seed(seed)
        self.states = {SHARDED: self._get()}
        self._set(saved)
        self.current = REPLICATED
        self._stack: list[str] = []

    def _get(self):
        cuda = torch.cuda.get_rng_state(self.device) if self.device is not None else None
        return torch.get_rng_state(), cuda

    def _set(self, states) -> None:
        cpu, cuda = states
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)

    def enter(self, stream: str) -> None:
        self._stack.append(self.current)
        self._switch(stream)

    def exit(self) -> None:
        self._switch(self._stack.pop())

    def _switch(self, stream: str) -> None:
        if stream == self.current:
            return
        self.states[self.current] = self._get()
        self._set(self.states.pop(stream))
        self.current = stream


def install_regions(root: nn.Module, regions: dict[str, str], streams: RNGStreams) -> None:
    """Hook every module named in ``regions`` (path -> stream) to run in its stream."""
    for path, stream in regions.items():
        if stream not in (SHARDED, REPLICATED):
            raise ValueError(f"rng region {path!r}: stream must be {SHARDED!r} or "
                             f"{REPLICATED!r}, not {stream!r}")
        module = root.get_submodule(path)
        module.register_forward_pre_hook(lambda mod, args, s=stream: streams.enter(s))
        module.register_forward_hook(lambda mod, args, out: streams.exit(), always_call=True)
