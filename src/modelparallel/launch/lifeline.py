"""End a process when the process that started it is gone.

torchrun starts every worker in a session of its own, and a job backend starts every
instance the same way, so a parent that is SIGKILLed (or a Ray node that is lost)
would leave them running with nobody to stop them. A daemon thread notices the
reparenting and signals this process.
"""

from __future__ import annotations

import os
import signal
import threading
import time


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
