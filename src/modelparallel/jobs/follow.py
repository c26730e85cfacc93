"""Following a file another process appends to (a log, a metrics file)."""

from __future__ import annotations

from pathlib import Path


class FollowedFile:
    """What was appended to ``path`` since the last read, in whole lines."""

    def __init__(self, path: Path, offset: int = 0):
        self.path = path
        self.offset = offset

    def read_new(self, to_end: bool = False) -> bytes:
        """The complete lines written since the last call (a line still being written
        waits for the next call, unless ``to_end``: the writer has finished)."""
        if not self.path.is_file():
            return b""
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = len(data) if to_end else data.rfind(b"\n") + 1
        self.offset += end
        return data[:end]
