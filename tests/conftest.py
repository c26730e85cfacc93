"""The suite's tiers and the session's worker groups.

Tiers (docs/testing.md#tiers): ``pytest`` runs the default tier, the README's test
command; tests marked ``extended`` (long fault and end-to-end runs whose every defect
also has a faster test in the default tier) run with ``--tier extended`` or ``--tier all``,
or when named on the command line. At the end the session prints the time each part of
the suite took.
"""

from __future__ import annotations

import collections
import time

import pytest

from modelparallel.testing import WorkerGroup

TIERS = ("default", "extended", "all")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--tier", choices=TIERS, default="default",
                     help="default: the README's test command; extended: the tests marked "
                          "extended only; all: both (docs/testing.md#tiers)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tier = config.getoption("--tier")
    named = any("::" in str(arg) for arg in config.args)  # tests asked for by name run
    if tier == "all" or named:
        return
    keep, drop = [], []
    for item in items:
        extended = item.get_closest_marker("extended") is not None
        (keep if extended == (tier == "extended") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _part(nodeid: str) -> str:
    """The part of the suite a test belongs to: its folder, the matrix on its own."""
    path = nodeid.split("::")[0]
    if path.endswith("test_parity_matrix.py"):
        return "parity matrix (CI subset)"
    folders = path.split("/")
    return folders[1] if len(folders) > 2 else folders[0]


class PartTimes:
    """Wall time per part of the suite: from a part's first test starting to its last
    ending, summed over the stretches the session spent in it (fixtures included)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.tests: dict[str, int] = collections.Counter()
        self._current: tuple[str, float] | None = None
        self.start = time.monotonic()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        start = time.monotonic()
        yield
        part = _part(item.nodeid)
        self.seconds[part] += time.monotonic() - start
        self.tests[part] += 1

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.tests:
            return
        total = time.monotonic() - self.start
        tier = terminalreporter.config.getoption("--tier")
        terminalreporter.write_sep("=", f"time by part (tier {tier}): {total / 60:.1f} min")
        for part, seconds in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{part:28} {self.tests[part]:5} tests "
                                        f"{seconds / 60:6.1f} min")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(PartTimes(), "modelparallel-part-times")


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
