"""An instance command run as a child process, as the local backend and the Ray actors
run it: in a session of its own, its output lines collected by a thread."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import threading
import time
from typing import Any


class InstanceProcess:
    """``command`` started now; each output line goes to ``lines`` (as ``(tag, line)``
    when a tag is given)."""

    def __init__(self, command: list[str], env: dict[str, str], lines: queue.Queue,
                 tag: Any = None):
        self.proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, text=True, errors="replace",
                                     bufsize=1)
        self.reader = threading.Thread(target=self._read, args=(lines, tag), daemon=True)
        self.reader.start()

    def _read(self, lines: queue.Queue, tag: Any) -> None:
        assert self.proc.stdout is not None  # started with stdout=PIPE
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            lines.put(line if tag is None else (tag, line))

    @property
    def ended(self) -> bool:
        """It exited, and nothing holds its output open any more."""
        return self.proc.poll() is not None and not self.reader.is_alive()

    def exit_code(self) -> int | None:
        """None while it runs; once it ended, after its last output line was collected."""
        code = self.proc.poll()
        if code is not None:
            self.reader.join(timeout=5)
        return code


def end_processes(processes: list[InstanceProcess], grace_s: float) -> None:
    """SIGTERM each process group (the torchrun agent and its workers), then SIGKILL
    what is left of them after ``grace_s``."""
    for p in processes:
        _signal_group(p.proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in processes:
        _signal_group(p.proc, signal.SIGKILL)  # stragglers of the group, even after exit
        p.proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
