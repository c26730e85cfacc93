"""Collective checkpoint calls must be made by every rank: check that before any
collective, so a call on some ranks only is an error naming them, not a hang."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from modelparallel.checkpoint.storage import CheckpointError
from modelparallel.context import ParallelContext


def timeout_s(ctx: ParallelContext) -> float:
    """How long a rank waits for the others: half the configured ``collective_timeout``,
    so that the ranks that did call report it before the others' next collective (which
    waits the whole timeout) fails with a mere timeout."""
    return ctx.config.collective_timeout / 2


def check_every_rank_calls(what: str, ctx: ParallelContext | None) -> None:
    """Raise a CheckpointError on the calling ranks unless every rank of the world calls
    ``what`` (e.g. ``"save_checkpoint(tag='step10')"``) within :func:`timeout_s`. Calls
    are numbered per ``ctx`` (one ``mp.init()``), alike on every rank.

    Uses the default group's key-value store (no collective), so ranks that are busy
    elsewhere cannot make this wait forever.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    # the default store is private API, but it is the only rendezvous every backend has
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    if ctx is None:
        raise RuntimeError(f"modelparallel is not initialized: call mp.init(config) before "
                           f"{what} on {world} ranks")
    timeout = timeout_s(ctx)
    prefix = f"modelparallel/checkpoint-call/{ctx.generation}/{next(ctx.checkpoint_calls)}"
    store.set(f"{prefix}/{rank}", what)
    keys = [f"{prefix}/{r}" for r in range(world)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as e:  # DistStoreError (timeout); which ranks are missing?
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        called = [r for r in range(world) if r not in missing]
        raise CheckpointError(
            f"{what} is collective, but only rank(s) {_ranks(called)} called it; rank(s) "
            f"{_ranks(missing)} did not within {timeout:g}s (half of collective_timeout). Call it "
            f"on every rank, e.g. not under `if mp.rank() == 0`") from e
    calls = {r: store.get(k).decode() for r, k in enumerate(keys)}
    if len(set(calls.values())) > 1:
        different = [f"rank {r}: {c}" for r, c in calls.items() if c != calls[0]][:4]
        raise CheckpointError(f"ranks disagree on the checkpoint call: rank 0: {calls[0]}; "
                              f"{'; '.join(different)}. Every rank must make the same call")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 16 else \
        f"{', '.join(map(str, ranks[:16]))}, ... ({len(ranks)} in all)"
