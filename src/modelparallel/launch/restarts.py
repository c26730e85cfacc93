"""Say when torchrun's agent restarts the worker group (``--max-restarts``).

torchrun restarts a failed group silently (its agent's log lines say only that the group
failed). The agent ``elastic_launch`` builds is replaced, while a run lasts, by one that
keeps the last result it saw and hands the failures of that result to ``say`` before
each restart that follows a failure (restarts for nodes joining are not announced). It
overrides two methods of torch's agent, ``_monitor_workers`` and ``_restart_workers``
(torch 2.13), calling torch's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.launcher import api

# (failures by global rank, the restart about to happen (1-based), the restarts allowed)
Announce = Callable[[Mapping[int, ProcessFailure], int, int], None]


@contextmanager
def announcing_restarts(say: Announce) -> Iterator[None]:
    """While the block runs, ``elastic_launch``'s agents call ``say`` before each restart
    of a failed worker group."""
    base = api.LocalElasticAgent

    class AnnouncingAgent(base):  # type: ignore[misc, valid-type]
        _last_result: Any = None
        _restarts_announced = 0

        def _monitor_workers(self, worker_group: Any) -> Any:
            self._last_result = super()._monitor_workers(worker_group)
            return self._last_result

        def _restart_workers(self, worker_group: Any) -> None:
            last, self._last_result = self._last_result, None
            if last is not None and last.is_failed():
                self._restarts_announced += 1
                say(last.failures, self._restarts_announced, worker_group.spec.max_restarts)
            super()._restart_workers(worker_group)

    api.LocalElasticAgent = AnnouncingAgent  # type: ignore[misc]
    try:
        yield
    finally:
        api.LocalElasticAgent = base  # type: ignore[misc]
