"""The ranks' shared notice board: each rank's state (its calls), stack requests and
answers, kept in the launcher's TCP store (``MASTER_ADDR``/``MASTER_PORT``) under a
prefix per restart. Reads never block on a rank that has not written."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any


class Board:
    def __init__(self, store: Any, rank: int, world: int):
        self.store, self.rank, self.world = store, rank, world

    @classmethod
    def from_environment(cls) -> Board | None:
        """The board of a worker started by torchrun (``modelparallel run``), else None."""
        env = os.environ
        if not all(k in env for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")):
            return None
        world = int(env["WORLD_SIZE"])
        if world < 2:
            return None
        import torch.distributed as dist

        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=30))
        prefix = f"mp-doctor/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        return cls(dist.PrefixStore(prefix, store), int(env["RANK"]), world)

    def publish(self, state: dict[str, Any]) -> None:
        self.store.set(f"state/{self.rank}", json.dumps(state))

    def states(self) -> list[dict[str, Any]]:
        """Every rank's last published state (ranks that never published are left out)."""
        keys = [f"state/{r}" for r in range(self.world)]
        present = [k for k in keys if self.store.check([k])]
        return [json.loads(v) for v in self.store.multi_get(present)] if present else []

    def request_stacks(self) -> int:
        return int(self.store.add("stack_request", 1))

    def pending_request(self) -> int:
        return int(self.store.add("stack_request", 0))

    def answer(self, request: int, where: dict[str, Any]) -> None:
        self.store.set(f"stack/{self.rank}", json.dumps({"request": request, **where}))

    def collect(self, request: int, ranks: list[int], wait: float) -> dict[int, dict[str, Any]]:
        """The answers to ``request`` of ``ranks``, waiting up to ``wait`` seconds."""
        found: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + wait
        while True:
            for r in ranks:
                key = f"stack/{r}"
                if r not in found and self.store.check([key]):
                    answer = json.loads(self.store.get(key))
                    if answer["request"] >= request:
                        found[r] = answer
            if len(found) == len(ranks) or time.monotonic() > deadline:
                return found
            time.sleep(0.1)
