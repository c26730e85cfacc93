"""Optimizer state sharded over data-parallel replicas (SMP v1's
``shard_optimizer_state``, ZeRO stage 1).

Replicas hold the whole parameters and all-reduce whole gradients, as without it; each
parameter's optimizer state is kept by one replica only, its *owner*. A step updates
each parameter on its owner (the others' gradients are hidden from the optimizer for
the step, so it creates no state for them) and the owners broadcast the new values
(one flat broadcast per owner and dtype). Parameters are given out whole, the largest
first, each to the replica holding the fewest elements so far; every replica computes
the same assignment from the parameters' global shapes, and tensor-parallel ranks of
one replica own the same parameters (their optimizers may reduce over the tensor
group, e.g. a trust-ratio norm).

The optimizer keeps every parameter in its groups (learning-rate schedulers and
gradient scaling see them all); only the state is partial. :meth:`gather_state` puts
the whole state on every replica for a moment (checkpoints, ``state_dict()``), and the
next step drops the others' parts again.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


class OptimizerStateSharding:
    """Which replica of ``group`` keeps the optimizer state of each of ``params``."""

    def __init__(self, params: list[torch.Tensor], group: dist.ProcessGroup):
        self.params = list({id(p): p for p in params}.values())
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        loads = [0] * self.size
        self.owner: dict[int, int] = {}
        order = sorted(range(len(self.params)), key=lambda i: (-self.params[i].numel(), i))
        for i in order:  # numel() is the global size, the same on tensor-parallel peers
            r = min(range(self.size), key=lambda k: (loads[k], k))
            self.owner[id(self.params[i])] = r
            loads[r] += self.params[i].numel()

    def owns(self, p: torch.Tensor) -> bool:
        """Whether this replica keeps ``p``'s state (parameters not sharded: yes)."""
        return self.owner.get(id(p), self.rank) == self.rank

    def owned(self) -> list[torch.Tensor]:
        return [p for p in self.params if self.owns(p)]

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` on the parameters this replica owns, then every replica
        takes each parameter's new value from its owner."""
        hidden = {id(p): p.grad for p in self.params if not self.owns(p)}
        for p in self.params:
            if id(p) in hidden:
                p.grad = None
        try:
            result = optimizer.step(*args, **kwargs)
        finally:
            for p in self.params:
                if id(p) in hidden:
                    p.grad = hidden[id(p)]
        self.drop_others(optimizer)
        self._broadcast()
        return result

    def drop_others(self, optimizer: torch.optim.Optimizer) -> None:
        """Forget the state of parameters other replicas own (after a gather or a load)."""
        for p in self.params:
            if not self.owns(p):
                optimizer.state.pop(p, None)

    @torch.no_grad()
    def _broadcast(self) -> None:
        for r in range(self.size):
            src = dist.get_global_rank(self.group, r)
            by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
            for p in self.params:
                if self.owner.get(id(p)) == r:
                    local = _local(p)
                    if local.numel():
                        by_kind.setdefault((local.dtype, local.device), []).append(local)
            for parts in by_kind.values():
                flat = torch.cat([t.reshape(-1) for t in parts])
                dist.broadcast(flat, src=src, group=self.group)
                if r != self.rank:
                    offset = 0
                    for t in parts:
                        t.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()

    def gather_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Every replica gets the whole state (collective over the group)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        mine = {index[id(p)]: {k: _portable(v) for k, v in optimizer.state[p].items()}
                for p in self.owned() if p in optimizer.state and id(p) in index}
        parts: list[Any] = [None] * self.size
        dist.all_gather_object(parts, mine, group=self.group)
        for r, part in enumerate(parts):
            if r == self.rank:
                continue
            for i, values in part.items():
                p = self.params[i]
                optimizer.state[p] = {k: _restore(v, p) for k, v in values.items()}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _portable(v: Any) -> Any:
    """A state value as it can be pickled across ranks (a DTensor as its local part)."""
    if isinstance(v, DTensor):
        return ("dtensor", v.to_local().detach().cpu())
    if isinstance(v, torch.Tensor):
        return ("tensor", v.detach().cpu(), v.device.type)
    return ("value", v)


def _restore(v: Any, p: torch.Tensor) -> Any:
    kind = v[0]
    if kind == "dtensor":
        assert isinstance(p, DTensor)
        return DTensor.from_local(v[1].to(_local(p).device), p.device_mesh, p.placements,
                                  run_check=False, shape=p.shape, stride=p.stride())
    if kind == "tensor":
        # a 0-dim step counter stays where torch keeps it (CPU unless capturable)
        return v[1] if v[2] == "cpu" else v[1].to(_local(p).device)
    return v[1]
