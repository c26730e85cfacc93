"""Notices for the user: one WARNING line per run, written by rank 0.

A notice says that something the user asked for has no effect here, or became
something else. The condition is the same on every rank, so rank 0 alone says it:
the launcher would otherwise print the line once per rank. WARNING, not INFO: the
``modelparallel`` logger has no handler of its own, and Python prints WARNING and above
of such a logger to stderr (its last-resort handler, or the handlers the script set up).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

logger = logging.getLogger("modelparallel")


def on_first_rank() -> bool:
    """Whether this process is rank 0: the process group's rank once there is one, the
    launcher's ``RANK`` before (0 outside a launcher)."""
    dist = sys.modules.get("torch.distributed")  # not imported for this: config uses it
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def notice(message: str, *args: Any) -> None:
    """Log ``message % args`` as a WARNING on rank 0 only."""
    if on_first_rank():
        logger.warning(message, *args)
