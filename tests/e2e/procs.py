"""What /proc says about processes: the tests' and the cluster fixtures' one reader."""

from __future__ import annotations

import os
from pathlib import Path


def stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, session id) of a process, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1]), int(fields[3])


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    st = stat(pid)
    return st is not None and st[0] != "Z"


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "(gone)"


def processes_naming(text: str, zombies: bool = False) -> list[int]:
    """Processes other than this one whose command line contains ``text`` (zombies
    left out unless asked for)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        try:
            named = text.encode() in (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if named and (zombies or alive(pid)):
            found.append(pid)
    return found


def tail(path: Path, lines: int) -> str:
    """The last lines of a log file."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
