"""The error of a configuration that cannot work (raised alike on every rank)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem, found before any process group or collective is used.

    ``problems`` holds one ``(key, message)`` pair per problem; the message of the
    exception lists them all.
    """

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        lines = [f"  - {key}: {msg}" for key, msg in problems]
        super().__init__("invalid modelparallel configuration:\n" + "\n".join(lines))

    @property
    def keys(self) -> list[str]:
        return [key for key, _ in self.problems]
