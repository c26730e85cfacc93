"""The error of a job that cannot be submitted as described."""

from __future__ import annotations


class JobError(ValueError):
    """A job cannot be submitted as described; ``problems`` holds ``(field, message)``."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        lines = [f"  - {name}: {msg}" for name, msg in problems]
        super().__init__("invalid training job:\n" + "\n".join(lines))

    @property
    def fields(self) -> list[str]:
        return [name for name, _ in self.problems]
