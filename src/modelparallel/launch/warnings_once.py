"""A Python warning that every rank emits alike is printed once per run, not once per rank.

Under ``modelparallel run`` each rank is its own interpreter, so Python's default
(each warning once per process and place) prints a warning from torch, the library or
the script once per rank: eight identical pairs of lines on eight GPUs. The launcher
gives the ranks of a node one folder (``FOLDER``); a rank about to print a warning
first claims its text there (a file named by the hash of the formatted warning,
created exclusively), and the ranks that find it claimed print nothing. So:

- identical text (same file, line, category and message) is printed once, by the rank
  that emitted it first, with that rank's prefix, when it is emitted: no line waits or
  moves;
- a warning whose text differs in anything (a rank number in the message) is printed by
  every rank that emits it;
- the rank that claimed a warning keeps printing it whenever Python's filters show it
  again (``simplefilter("always")``), the others never;
- with ``--ranks-filter`` only the shown ranks take part (``RANKS``), so a warning is
  never claimed by a rank whose output the terminal hides.

The folder is per node (a temporary directory of the launcher), so on several nodes a
warning is printed once per node. The run directory's log of a rank that found a warning
claimed does not hold it either.
"""

from __future__ import annotations

import hashlib
import os
import warnings

FOLDER = "MP_WARNINGS_DIR"  # where the ranks of a node claim the warnings they print
RANKS = "MP_WARNINGS_RANKS"  # the local ranks whose output is shown ("0,3"), if not all


def fold_from_environment() -> None:
    """In a worker of ``modelparallel run``: print a warning only if no other rank of
    this node has printed the same text (a no-op outside the launcher)."""
    folder = os.environ.get(FOLDER)
    shown_ranks = os.environ.get(RANKS)
    if not folder or (shown_ranks and os.environ.get("LOCAL_RANK")
                      not in shown_ranks.split(",")):
        return
    show = warnings.showwarning
    claimed: set[str] = set()

    def show_once(message, category, filename, lineno, file=None, line=None):
        if file is None:  # the default destination, stderr: the terminal every rank shares
            text = warnings.formatwarning(message, category, filename, lineno, line)
            key = hashlib.sha256(text.encode()).hexdigest()
            if key not in claimed:
                if not _claim(os.path.join(folder, key)):
                    return  # another rank has printed it
                claimed.add(key)
        show(message, category, filename, lineno, file, line)

    warnings.showwarning = show_once


def _claim(path: str) -> bool:
    """Whether this process is the first to claim ``path`` (True also when the folder
    is gone: better printed twice than never)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True
