"""The per-rank doctor: records this process's calls, publishes them every half second,
answers stack requests, and ends the run with a diagnosis when it finds ranks that
diverged, a rank that finished early, or ranks waiting for each other.

A rank blocked in a call for ``stuck_after`` seconds compares its call with the other
ranks' (cheap: nothing is read while calls complete). Only definite faults end the run
early; a rank that is merely slow is waited for until the collective timeout, after
which ``explain`` (main thread) or, if the backend never raises, the watchdog reports
who did not arrive and where they are.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from modelparallel.doctor import diagnose, frames
from modelparallel.doctor.board import Board
from modelparallel.doctor.recorder import Recorder

logger = logging.getLogger("modelparallel")


class Doctor:
    """One rank's doctor; ``on_verdict(message)`` ends the process with the diagnosis."""

    def __init__(self, board: Board, on_verdict: Callable[[str], None],
                 timeout: Callable[[], float], stuck_after: float = 3.0,
                 period: float = 0.5):
        self.board, self.on_verdict, self.timeout = board, on_verdict, timeout
        self.stuck_after, self.period = stuck_after, period
        self.recorder = Recorder()
        self.done = False
        self.failed: dict[str, Any] | None = None
        self.timed_out = False  # this rank's collective timed out (it waited for others)
        self._stop = threading.Event()
        self._answered = 0
        self._published: tuple[int, bool, bool] | None = None
        self._checked_at = 0.0
        self._connecting = threading.Lock()
        self._board_failed = False
        self._thread = threading.Thread(target=self._run, name="modelparallel-doctor",
                                        daemon=True)

    def start(self) -> None:
        self.recorder.install()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.recorder.uninstall()

    def finish(self) -> None:
        """The script ended normally: tell the others (a rank waiting for this one
        learns it will never come)."""
        self.done = True
        if self._connected():  # a rank that ended before its watchdog connected
            self._publish(force=True)
        self.stop()

    def state(self) -> dict[str, Any]:
        current = self.recorder.current
        return {"rank": self.board.rank, "done": self.done, "time": time.time(),
                "current": current.as_dict() if current else None,
                "recent": [c.as_dict() for c in list(self.recorder.recent)[-32:]],
                "failed": self.failed, "timed_out": self.timed_out,
                "seqs": dict(self.recorder.seqs)}

    def _publish(self, force: bool = False) -> None:
        if not self.board.connected:
            return
        mark = (self.recorder.calls, self.recorder.current is None, self.done)
        if force or mark != self._published:
            self._published = mark
            self.board.publish(self.state())

    def _run(self) -> None:
        while not self._connected():
            if self._stop.wait(self.period) or self._board_failed:
                return
        self._publish(force=True)
        while not self._stop.wait(self.period):
            try:
                self._tick()
            except Exception as error:  # the store is gone: the run is ending anyway
                logger.debug("modelparallel doctor stopped: %s", error)
                return

    def _connected(self) -> bool:
        """Connect the board once this rank's process group exists (either thread)."""
        import torch.distributed as dist

        with self._connecting:
            if self.board.connected or self._board_failed or not dist.is_initialized():
                return self.board.connected
            try:
                self.board.connect()
            except Exception as error:
                self._board_failed = True
                logger.warning("modelparallel doctor is off for this rank: no store at %s:%s "
                               "(%s; MP_DOCTOR=0 silences this)",
                               self.board.host, self.board.port, error)
            return self.board.connected

    def _tick(self) -> None:
        self._publish()
        request = self.board.pending_request()
        if request > self._answered:
            self._answered = request
            self.board.answer(request, self.where())
        current = self.recorder.current
        if current is None:
            return
        blocked = time.time() - current.start
        now = time.monotonic()
        if blocked > self.stuck_after and now - self._checked_at > 2 * self.period:
            self._checked_at = now
            states = self.board.states()
            verdict = diagnose.divergence(states) or \
                diagnose.finished_early(states, self.board.rank) or diagnose.cycle(states)
            if verdict is None and blocked > self.timeout() + 15:
                # the backend did not raise at its timeout (NCCL's watchdog may abort)
                verdict = self.report_timeout(current.as_dict(), blocked)
            if verdict is not None:
                self.on_verdict(verdict)

    def where(self) -> dict[str, Any]:
        """Where this rank's main thread is, and the call it is blocked in."""
        current = self.recorder.current
        return {**frames.describe(frames.main_thread_frame()),
                "call": current.as_dict() if current else None}

    def report_timeout(self, call: dict[str, Any] | None, waited: float | None,
                       here: str | None = None) -> str:
        """Ask every rank where it is and say who did not arrive (``here``: this rank's
        own line, when its stack no longer shows it)."""
        self.failed, self.timed_out = call, True
        self._publish(force=True)
        request = self.board.request_stacks()
        others = [r for r in range(self.board.world) if r != self.board.rank]
        stacks = self.board.collect(request, others, wait=5.0)
        stacks[self.board.rank] = {**self.where(), **({"site": here} if here else {})}
        return diagnose.timed_out(call, self.board.rank, self.board.states(), stacks, waited)

    def explain(self, timed_out: bool, here: str | None = None) -> str | None:
        """After this rank's call failed (main thread, ``here`` the user's line it
        failed at): ranks that diverged, or, for a timeout, who did not arrive and
        where they are."""
        if not self._connected():
            return None
        failed = self.recorder.last_failed
        self.failed = failed.as_dict() if failed else None
        self.timed_out = timed_out
        self._publish(force=True)
        time.sleep(2 * self.period)  # the others publish what they are doing
        states = self.board.states()
        verdict = diagnose.divergence(states) or \
            diagnose.finished_early(states, self.board.rank)
        if verdict is None and timed_out:
            waited = time.time() - failed.start if failed else None
            verdict = self.report_timeout(self.failed, waited and round(waited), here)
        return verdict
