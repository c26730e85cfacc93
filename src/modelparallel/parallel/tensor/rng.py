"""Random numbers under tensor parallelism (SMP's ``random_seed`` / ``tensor_parallel_seed``).

The ranks of a tensor-parallel group compute one model, so where activations are
replicated over them they must draw the same dropout masks, and where activations are
split (attention heads between a column- and a row-parallel layer) each must draw its
own. Three streams:

- outside any marked region: the script's global generator. ``transform`` gives every
  rank of a group its first rank's generator state, so masks agree even when a script
  seeds with ``seed + rank``; with the same seed as one process they are the masks one
  process draws on the group's concatenated batch (SMP v2: "matching non-TP results").
- regions a plan marks ``REPLICATED``: a generator seeded with ``tensor_parallel_seed``
  (SMP v1), the same on every rank.
- regions a plan marks ``SHARDED``: a generator seeded with ``random_seed`` plus the
  tensor-parallel rank (and 1000 x the pipeline rank): each rank its own masks (SMP v2).

Module hooks switch streams on entry and restore on exit, so regions nest.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from modelparallel.parallel.tensor.plans import REPLICATED, SHARDED

GLOBAL = "global"


class RNGStreams:
    """The generator states of this rank's streams; the current one is the live global
    generator, the others are kept aside."""

    def __init__(self, sharded_seed: int, replicated_seed: int, device: torch.device):
        self.device = device if device.type == "cuda" else None
        saved = self._get()
        self.states = {}
        for stream, seed in ((SHARDED, sharded_seed), (REPLICATED, replicated_seed)):
            torch.manual_seed(seed)
            self.states[stream] = self._get()
        self._set(saved)
        self.current = GLOBAL
        self._stack: list[str] = []

    def _get(self):
        cuda = torch.cuda.get_rng_state(self.device) if self.device is not None else None
        return torch.get_rng_state(), cuda

    def _set(self, states) -> None:
        cpu, cuda = states
        torch.set_rng_state(cpu)
        if cuda is not None:
            assert self.device is not None  # a CUDA state is taken only with a CUDA device
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

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The kept-aside streams' CPU states (outside any region, for checkpoints)."""
        if self.current != GLOBAL:
            raise RuntimeError("RNG streams are saved between forwards, not inside one")
        return {name: cpu for name, (cpu, _) in self.states.items()}

    def load_state_dict(self, states: dict[str, torch.Tensor]) -> None:
        for name, cpu in states.items():
            self.states[name] = (cpu, self.states[name][1])


_STREAMS_ATTR = "_mp_rng_streams"


def install_regions(root: nn.Module, regions: dict[str, str], streams: RNGStreams) -> None:
    """Hook every module named in ``regions`` (path -> stream) to run in its stream; the
    streams are kept on ``root`` (see :func:`streams_of`)."""
    for path, stream in regions.items():
        if stream not in (SHARDED, REPLICATED):
            raise ValueError(f"rng region {path!r}: stream must be {SHARDED!r} or "
                             f"{REPLICATED!r}, not {stream!r}")
        module = root.get_submodule(path)
        module.register_forward_pre_hook(lambda mod, args, s=stream: streams.enter(s))
        module.register_forward_hook(lambda mod, args, out: streams.exit(), always_call=True)
    object.__setattr__(root, _STREAMS_ATTR, streams)


def streams_of(model: nn.Module) -> RNGStreams | None:
    """The tensor-parallel RNG streams ``transform`` installed on ``model`` (or on the
    module a wrapper holds), if any."""
    for module in model.modules():
        streams = module.__dict__.get(_STREAMS_ATTR)
        if streams is not None:
            return streams
    return None


def synchronize_global(group: dist.ProcessGroup, device: torch.device) -> None:
    """Give every rank of ``group`` the global generator state of its first rank."""
    if dist.get_world_size(group) == 1:
        return
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    dist.broadcast_object_list(states, src=dist.get_global_rank(group, 0), group=group)
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)
