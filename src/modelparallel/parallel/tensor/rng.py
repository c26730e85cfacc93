"""Random numbers under tensor parallelism (SMP's ``random_seed`` / ``tensor_parallel_seed``).

The ranks of a tensor-parallel group compute one model, so where activations are
replicated over them they must draw the same dropout masks, and where activations are
split (attention heads between a column- and a row-parallel layer, sequence shards
under sequence parallelism) each must draw its own. The rule (docs/tensor-parallel.md,
"Random numbers"):

- outside any marked region the script's generator draws. ``transform`` gives every
  rank of a group its first rank's generator state, so the group draws alike even when
  a script seeds with ``seed + rank``.
- each entry into a region a plan marks draws from a generator seeded with a hash of
  the generator state at the entry, the region's name, its kind and seed (``SHARDED``:
  ``random_seed`` and the tensor-parallel rank; ``REPLICATED``: ``tensor_parallel_seed``)
  and the data-parallel rank. At the exit the state at the entry comes back, moved on to
  another hash of it if the region drew, so a second entry never repeats the first's
  masks.
- a forward of the transformed model that drew leaves the script's generator at a hash
  of the state it started from, whatever its regions drew: pipeline stages hold
  different regions but stay in step (a ``DataLoader`` that shuffles with the global
  generator reads the same order on every stage). A forward that drew nothing (no
  dropout) leaves it as it was, as one process does.

Everything a region draws is a function of the generator state at its entry. Activation
checkpointing (torch's ``checkpoint`` reentrant or not, the wrappers built on it,
Hugging Face's ``gradient_checkpointing_enable``) restores that state before it
recomputes, so the recomputation draws exactly the forward's masks; no stream state is
kept aside that a recomputation could find already advanced. Module hooks enter and
leave the regions, so they nest.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from modelparallel.parallel.tensor.plans import REPLICATED, SHARDED

_State = tuple[torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class RegionSeeds:
    """What tells apart the masks of ranks and regions, besides the generator state."""

    random_seed: int  # SHARDED regions (SMP v2's ``random_seed``)
    tensor_parallel_seed: int  # REPLICATED regions (SMP v1's ``tensor_parallel_seed``)
    tp_rank: int
    dp_rank: int  # this rank's data-parallel replica (its own samples)

    def key(self, kind: str, path: str) -> bytes:
        parts: tuple[object, ...] = (kind, self.tensor_parallel_seed, self.dp_rank, path)
        if kind == SHARDED:
            parts = (kind, self.random_seed, self.tp_rank, self.dp_rank, path)
        return repr(parts).encode()


@dataclass
class _Open:
    """A region or forward in progress."""

    entered: _State  # the live generators' state when it began
    resume: int  # what they go on from when it ends, if anything in it drew
    seeded: _State | None = None  # a region's generators before anything drew
    # in a SHARDED region: the chain REPLICATED regions inside it derive from, which is
    # equal on every rank of the group (the live generator is this rank's own there)
    replicated: int | None = None


class RegionRandomness:
    """Seeds the live generators (CPU, and the CUDA device's if the model is there) for
    the regions of one transformed model."""

    def __init__(self, seeds: RegionSeeds, device: torch.device):
        self.seeds = seeds
        self.device = device if device.type == "cuda" else None
        self._open: list[_Open] = []

    # -- the live generators ----------------------------------------------------------
    def _state(self) -> _State:
        cuda = torch.cuda.get_rng_state(self.device) if self.device is not None else None
        return torch.get_rng_state(), cuda

    def _set(self, state: _State) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None and self.device is not None:
            torch.cuda.set_rng_state(state[1], self.device)

    def _seed(self, seed: int) -> None:
        torch.default_generator.manual_seed(seed)
        if self.device is not None:
            index = self.device.index if self.device.index is not None else \
                torch.cuda.current_device()
            torch.cuda.default_generators[index].manual_seed(_mix(seed, b"cuda"))

    def _drew(self, since: _State) -> bool:
        # compared as bytes, outside torch's dispatch (the planner runs under fake tensors)
        return _bytes(self._state()) != _bytes(since)

    def _sharded(self) -> _Open | None:
        return next((o for o in reversed(self._open) if o.replicated is not None), None)

    # -- hooks --------------------------------------------------------------------------
    def enter(self, kind: str, path: str) -> None:
        state = self._state()
        key = self.seeds.key(kind, path)
        outer = self._sharded()
        basis = None  # inside a SHARDED region: the group's chain, advanced for the next
        if outer is not None and outer.replicated is not None:
            basis, outer.replicated = outer.replicated, _mix(outer.replicated, b"next")
        region = _mix(basis, key) if kind == REPLICATED and basis is not None \
            else _hash(state, key)
        chain = None
        if kind == SHARDED:
            chain = _mix(basis, b"replicated") if basis is not None else \
                _hash(state, b"replicated")
        self._seed(region)
        self._open.append(_Open(state, _hash(state, b"after region"), self._state(), chain))

    def exit(self) -> None:
        region = self._open.pop()
        assert region.seeded is not None
        if self._drew(region.seeded):  # the next entry must not repeat these masks
            self._seed(region.resume)
        else:  # nothing drawn: the script's generator as it was
            self._set(region.entered)

    def forward_started(self) -> None:
        state = self._state()
        self._open.append(_Open(state, _hash(state, b"after forward")))

    def forward_ended(self) -> None:
        if not self._open:  # (a forward hook runs even when the pre-hook's forward raised)
            return
        forward = self._open.pop()
        if self._drew(forward.entered):  # whatever this stage's regions drew
            self._seed(forward.resume)


def _bytes(state: _State) -> bytes:
    cpu, cuda = state
    return cpu.numpy().tobytes() + (cuda.numpy().tobytes() if cuda is not None else b"")


def _hash(state: _State, *extra: bytes) -> int:
    """A seed from generators' ``state`` and ``extra``."""
    h = hashlib.blake2b(_bytes(state), digest_size=8)
    for part in extra:
        h.update(b"|" + part)
    return int.from_bytes(h.digest(), "little") >> 1  # a non-negative 63-bit seed


def _mix(seed: int, salt: bytes) -> int:
    h = hashlib.blake2b(seed.to_bytes(8, "little") + salt, digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1


def install_regions(root: nn.Module, regions: dict[str, str], seeds: RegionSeeds,
                    device: torch.device) -> RegionRandomness:
    """Hook every module named in ``regions`` (path -> ``SHARDED`` or ``REPLICATED``) to
    draw from its region's generator, and ``root``'s forward to leave the script's
    generator, if it drew, at a state that depends only on the one it started from."""
    randomness = RegionRandomness(seeds, device)
    for path, kind in regions.items():
        if kind not in (SHARDED, REPLICATED):
            raise ValueError(f"rng region {path!r}: must be {SHARDED!r} or {REPLICATED!r}, "
                             f"not {kind!r}")
        module = root.get_submodule(path)
        module.register_forward_pre_hook(
            lambda mod, args, k=kind, p=path: randomness.enter(k, p))
        module.register_forward_hook(lambda mod, args, out: randomness.exit(),
                                     always_call=True)
    if regions:
        root.register_forward_pre_hook(lambda mod, args: randomness.forward_started())
        root.register_forward_hook(lambda mod, args, out: randomness.forward_ended(),
                                   always_call=True)
        if device.type == "cpu":
            # sequence-parallel dropout acts on DTensors; on a CPU mesh torch runs it on
            # the local shard with the live generator, which the regions seed per rank
            warnings.filterwarnings("ignore", message="DTensor random operators may not "
                                    "have complete support on cpu")
    return randomness


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
