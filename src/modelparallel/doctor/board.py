"""The ranks' shared notice board: each rank's state (its calls), stack requests and
answers, kept in the TCP store at ``MASTER_ADDR``/``MASTER_PORT`` under a prefix per
restart. Reads never block on a rank that has not written.

That store is the launcher's (torchrun shares its rendezvous store) or, when the launcher
does not share it (``--max-restarts`` > 0), the one rank 0 hosts from
``init_process_group`` on: the board connects once a process group exists
(``connect``), never before, so a rank never waits on a store nobody hosts yet."""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta
from typing import Any


class Board:
    def __init__(self, host: str, port: int, restart: str, rank: int, world: int):
        self.host, self.port, self.restart = host, port, restart
        self.rank, self.world = rank, world
        self.store: Any = None

    @classmethod
    def from_environment(cls) -> Board | None:
        """The (unconnected) board of a worker started by torchrun, else None."""
        env = os.environ
        if not all(k in env for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")):
            return None
        world = int(env["WORLD_SIZE"])
        if world < 2:
            return None
        return cls(env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                   env.get("TORCHELASTIC_RESTART_COUNT", "0"), int(env["RANK"]), world)

    @property
    def connected(self) -> bool:
        return self.store is not None

    def connect(self, timeout: float = 30.0) -> None:
        """Connect to the store (call once this rank's process group exists)."""
        import torch.distributed as dist

        # a silent probe first: a TCPStore client to a port nobody hosts (a process group
        # initialised another way than env://) logs a C++ stack trace per retry
        socket.create_connection((self.host, self.port), timeout=timeout).close()
        store = dist.TCPStore(self.host, self.port, is_master=False,
                              timeout=timedelta(seconds=timeout))
        self.store = dist.PrefixStore(f"mp-doctor/{self.restart}/", store)

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
