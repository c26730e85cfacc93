import pytest

from modelparallel.testing import WorkerGroup


class WorkerGroups:
    """One live WorkerGroup per world size, shared by the whole test session."""

    def __init__(self):
        self._groups: dict[int, WorkerGroup] = {}

    def __call__(self, world_size: int) -> WorkerGroup:
        if world_size not in self._groups:
            self._groups[world_size] = WorkerGroup(world_size)
        return self._groups[world_size]

    def close(self):
        for g in self._groups.values():
            g.close()


@pytest.fixture(scope="session")
def workers():
    groups = WorkerGroups()
    yield groups
    groups.close()
