"""The hang and divergence doctor of ``modelparallel run``.

Every worker the launcher starts records its ``torch.distributed`` calls
(``recorder``), publishes them to the launcher's store (``board``), and watches
(``watchdog``). When ranks issue different collectives, when one finishes while others
wait for it, or when ranks wait for each other, the run ends within seconds with the
ranks, their lines and what differs (``diagnose``); when a collective times out, the
report names the ranks that did not arrive and the line each one is at.

``MP_DOCTOR=0`` in the environment turns it off (``docs/doctor.md``; its cost is
measured by ``bench/doctor_overhead.py``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from modelparallel.doctor import diagnose
from modelparallel.doctor.board import Board
from modelparallel.doctor.watchdog import Doctor

SWITCH = "MP_DOCTOR"
FOLDER = "MP_DOCTOR_DIR"  # where each rank keeps its last call (set by the launcher)
DEFAULT_TIMEOUT = 600.0


def configured_timeout() -> float | None:
    """The ``collective_timeout`` ``mp.init`` configured in this process, if it ran."""
    state_module = sys.modules.get("modelparallel.smp.state")  # never import it for this
    config = getattr(getattr(state_module, "state", None), "config", None)
    return None if config is None else float(config.collective_timeout)


def collective_timeout() -> float:
    """The configured ``collective_timeout`` once ``mp.init`` ran, else the default."""
    configured = configured_timeout()
    return DEFAULT_TIMEOUT if configured is None else configured


def start_from_environment(on_verdict: Callable[[str], None]) -> Doctor | None:
    """Start this worker's doctor (under ``modelparallel run``, more than one rank,
    unless ``MP_DOCTOR=0``); None otherwise."""
    if os.environ.get(SWITCH, "1") == "0":
        return None
    board = Board.from_environment()
    if board is None:
        return None
    doctor = Doctor(board, on_verdict, collective_timeout)
    folder = os.environ.get(FOLDER)
    if folder:
        doctor.recorder.last_call_fd = os.open(os.path.join(folder, f"rank-{board.rank}.json"),
                                               os.O_RDWR | os.O_CREAT, 0o600)
    doctor.start()
    return doctor


def postmortem(folder: str | os.PathLike) -> str | None:
    """What the ranks' last calls (``MP_DOCTOR_DIR``, read by the launcher after the
    run) say: ranks that diverged, even if they died without a word."""
    states = []
    for path in sorted(Path(folder).glob("rank-*.json")):
        text = path.read_bytes().rstrip(b" \x00")
        if text:
            call = json.loads(text)
            states.append({"rank": int(path.stem.split("-")[1]), "current": call,
                           "recent": [], "done": False})
    return diagnose.divergence(states)


__all__ = ["FOLDER", "SWITCH", "Doctor", "collective_timeout", "configured_timeout", "postmortem",
           "start_from_environment"]
