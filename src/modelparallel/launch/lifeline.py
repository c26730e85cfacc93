"""No process of a run outlives it.

Every process a run starts carries the run's mark, ``MODELPARALLEL_LAUNCH_MARK`` in its
environment (the launcher sets it; workers, their multiprocessing and data loader
processes and anything else they start inherit it). Three things use it:

- each worker asks the kernel for SIGKILL when the launcher ends (``die_with_parent``:
  ``PR_SET_PDEATHSIG``), so a launcher that is SIGKILLed takes its ranks with it;
- a small guard process (``RunLifeline``, in a session of its own) waits for the
  launcher to end, however it ends, and then SIGKILLs whatever still carries the mark:
  the workers' own children, which the parent-death signal does not reach;
- when the run ends, the launcher stops whatever still carries the mark: SIGTERM,
  then SIGKILL for processes that ignore it or do not end within a grace period.

This file imports nothing from modelparallel: the guard runs it as a script, without
importing torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

MARK = "MODELPARALLEL_LAUNCH_MARK"  # names every process of one run
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """End this process with ``sig`` when its parent ends: the kernel's parent-death
    signal on Linux, else a thread that notices the reparenting."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    except (OSError, AttributeError):  # not Linux
        follow_parent(sig)
        return
    if os.getppid() != parent or parent == 1:  # the parent ended before prctl
        os.kill(os.getpid(), sig)


def follow_parent(sig: int = signal.SIGKILL, interval_s: float = 1.0,
                  kill_after_s: float | None = None) -> None:
    """Send ``sig`` to this process once its parent has ended, and SIGKILL
    ``kill_after_s`` later if it is still there (a Python signal handler cannot run
    while the main thread waits in C++, e.g. in torchrun's exit barrier)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os.kill(os.getpid(), sig)
        if kill_after_s is not None:
            time.sleep(kill_after_s)
            os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="follow-parent", daemon=True).start()


def marked(mark: str) -> list[int]:
    """The live processes (zombies left out) other than this one that carry ``mark``."""
    entry = f"\0{MARK}={mark}\0".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if entry in b"\0" + (proc / "environ").read_bytes() + b"\0" and \
                    (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(proc.name))
        except (OSError, IndexError):  # gone meanwhile, or not ours to read
            continue
    return found


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):  # gone meanwhile
            os.kill(pid, sig)


def end_marked(mark: str, grace_s: float = 3.0) -> list[int]:
    """Stop every process carrying ``mark``: SIGTERM, and SIGKILL for those still there
    ``grace_s`` later (also processes they started meanwhile). The pids it found."""
    found = marked(mark)
    if not found:
        return []
    _signal_all(found, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (left := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for _ in range(10):  # a process may start another while being killed
        if not left:
            break
        found += left
        _signal_all(left, signal.SIGKILL)
        time.sleep(0.1)
        left = marked(mark)
    return sorted(set(found))


class RunLifeline:
    """The run's mark in this process's environment (for the workers it starts) and the
    guard that ends the marked processes once this process has ended."""

    def __init__(self) -> None:
        self.mark = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(6)}"
        self._saved = os.environ.get(MARK)
        guard_env = {k: v for k, v in os.environ.items() if k != MARK}
        # its own session: Ctrl-C in the terminal and a kill of the launcher's process
        # group do not reach it; it ends when its stdin (held by this process) closes
        self.guard = subprocess.Popen(
            [sys.executable, "-S", os.path.abspath(__file__), self.mark], env=guard_env,
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
        os.environ[MARK] = self.mark

    def close(self, grace_s: float = 3.0) -> list[int]:
        """End what is left of the run (see ``end_marked``), then the guard."""
        if self._saved is None:
            os.environ.pop(MARK, None)
        else:
            os.environ[MARK] = self._saved
        held = {}
        if threading.current_thread() is threading.main_thread():
            # a second Ctrl-C must not cut the cleanup short (torchrun's handler raises)
            held = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT,
                                                                   signal.SIGTERM)}
        try:
            left = end_marked(self.mark, grace_s)
        finally:
            for sig, handler in held.items():
                signal.signal(sig, handler)
        if self.guard.stdin is not None:
            self.guard.stdin.close()
        try:
            self.guard.wait(5)
        except subprocess.TimeoutExpired:
            self.guard.kill()
        return left

    def __enter__(self) -> RunLifeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def guard(mark: str) -> None:
    """Wait until the launcher ends (stdin reaches its end), then SIGKILL the run's
    processes that are left."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while sys.stdin.buffer.read(1 << 16):
        pass
    end_marked(mark, grace_s=0.0)


if __name__ == "__main__":
    guard(sys.argv[1])
