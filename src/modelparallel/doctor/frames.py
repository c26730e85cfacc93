"""Where a process is: the innermost frame of the user's own code, and a short stack.

"User code" is every file outside torch, modelparallel and the Python installation
(standard library and site-packages), so a collective called from inside the library
is placed at the user's line that led to it.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import threading
from types import FrameType

_LIBRARY_DIRS = tuple({os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
                       *(os.path.abspath(p) + os.sep for p in {
                           sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
                           sysconfig.get_paths()["platlib"]})})
_THIS_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


@functools.lru_cache(maxsize=4096)
def is_user_file(filename: str) -> bool:
    """Whether ``filename`` is the user's (not the library's, torch's or Python's)."""
    if filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    return not path.startswith(_LIBRARY_DIRS) and "site-packages" not in path


def site(frame: FrameType | None) -> str:
    """``file:line`` of the innermost user frame at or above ``frame`` (else the innermost
    frame outside this package)."""
    fallback = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if is_user_file(filename):
            return f"{filename}:{frame.f_lineno}"
        if fallback is None and not os.path.abspath(filename).startswith(_THIS_PACKAGE):
            fallback = f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return fallback or "?"


def main_thread_frame() -> FrameType | None:
    """The main thread's current frame (what the process is doing)."""
    return sys._current_frames().get(threading.main_thread().ident or -1)


def describe(frame: FrameType | None, depth: int = 6) -> dict[str, object]:
    """The user's site, the innermost function, and up to ``depth`` frames, innermost
    first, as ``file:line in function``."""
    frames: list[str] = []
    inner = frame
    while frame is not None and len(frames) < depth:
        frames.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return {"site": site(inner), "function": inner.f_code.co_name if inner else "?",
            "stack": frames}
