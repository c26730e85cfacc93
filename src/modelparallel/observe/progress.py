"""Progress of a training run on rank 0: a tqdm bar with an ETA on a terminal, plain
lines with the same figures anywhere else (log files, pipes, CI).

Under ``modelparallel run`` a worker's output is a file the launcher tails, never a
terminal, so the launcher passes its own terminal in ``MP_PROGRESS_TTY`` when it has
one: rank 0 draws the bar there, and its step lines still go to its output (and so to
the logs). A bar written to a file would fill it with carriage returns; that is why
anything that is not a terminal gets whole lines instead.
"""

from __future__ import annotations

import os
import time
from typing import IO, Any

from tqdm import tqdm

PROGRESS_TTY = "MP_PROGRESS_TTY"  # the launcher's terminal (modelparallel.launch.run_dir)


def format_eta(seconds: float) -> str:
    """``mm:ss`` or ``h:mm:ss``, as tqdm shows it."""
    return tqdm.format_interval(max(0.0, seconds))


class _LineStart:
    """A terminal written to by two processes: the bar (here) and the launcher, which
    prints the ranks' lines. After drawing the bar the cursor goes back to the start of
    the line, so the launcher's next line overwrites the bar instead of being appended
    to it; the bar is drawn again below at the next step."""

    def __init__(self, stream: IO[str]):
        self.stream = stream

    def write(self, text: str) -> int:
        return self.stream.write(text + "\r")

    def flush(self) -> None:
        self.stream.flush()

    def close(self) -> None:
        self.stream.close()


class Progress:
    """Steps done out of ``total``, the rate and the time left.

    ``stream`` is where the program's lines go (rank 0's standard output; ``None`` when
    they go elsewhere, e.g. a custom printer). When it is a terminal, a tqdm bar is
    drawn there and step lines are written through the bar (:attr:`owns_lines`).
    Otherwise, when ``MP_PROGRESS_TTY`` names a terminal (the
    launcher's), the bar is drawn on that terminal. Otherwise there is no bar and
    :meth:`suffix` adds ``| 25/300 8% ETA 01:52`` to each step line.
    """

    def __init__(self, total: int, stream: IO[str] | None, *, tty_path: str | None = None):
        if total < 1:
            raise ValueError(f"total_steps must be at least 1, not {total}")
        self.total = total
        self.started = time.monotonic()
        self.first_step_end: float | None = None
        self.done = 0
        self.owns_lines = stream is not None and _isatty(stream)
        self._stream = stream if self.owns_lines else None
        tty_path = tty_path if tty_path is not None else os.environ.get(PROGRESS_TTY)
        target: Any = None
        self._tty: IO[str] | None = None
        if self.owns_lines:
            target = stream
        elif tty_path:
            try:
                self._tty = open(tty_path, "w")  # noqa: SIM115  (closed in close())
            except OSError:  # the terminal went away (the launcher was detached)
                self._tty = None
            if self._tty is not None and self._tty.isatty():
                target = _LineStart(self._tty)
        self.bar: tqdm | None = None
        if target is not None:
            self.bar = tqdm(total=total, file=target, unit="step", ncols=80,
                            mininterval=0.5, leave=True, desc="train")

    @property
    def drawing(self) -> bool:
        """Whether a bar is drawn on a terminal (else lines carry the progress)."""
        return self.bar is not None

    def advance(self, step_time_s: float | None = None) -> None:
        """One more step done (``step_time_s``: how long it took, for the first step's
        ETA)."""
        self.done += 1
        if self.first_step_end is None:
            self.first_step_end = time.monotonic()
            if step_time_s is not None:
                self.started = self.first_step_end - step_time_s
        if self.bar is not None and self.done <= self.total:
            self.bar.update(1)
            if self.done == self.total:
                self.close()

    def eta_s(self) -> float:
        """Seconds left at the rate of the steps after the first (which includes the
        warm-up), wall time between their ends; from the first step alone until there
        is a second."""
        now = time.monotonic()
        left = max(0, self.total - self.done)
        if self.done >= 2 and self.first_step_end is not None:
            rate = (now - self.first_step_end) / (self.done - 1)
        elif self.done:
            rate = (now - self.started) / self.done
        else:
            return float("nan")
        return left * rate

    def suffix(self) -> str:
        """``| 25/300 8% ETA 01:52``: the progress part of a plain step line."""
        if self.done > self.total:
            return f" | {self.done} steps (total_steps={self.total} passed)"
        return (f" | {self.done}/{self.total} {self.done / self.total:.0%} "
                f"ETA {format_eta(self.eta_s())}")

    def write(self, line: str) -> None:
        """Write a line through the bar (only when :attr:`owns_lines`)."""
        assert self.bar is not None and self._stream is not None
        self.bar.write(line, file=self._stream)  # clears the bar, writes, redraws it

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self._tty is not None:
            self._tty.close()
            self._tty = None


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-less stream
        return False
