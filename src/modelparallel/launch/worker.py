"""Run a user's script as one worker, recording an uncaught error for the launcher.

``python -m modelparallel.launch.worker script.py [args...]`` runs the script as
``__main__`` (like ``python script.py``). An uncaught exception is printed once,
without the wrapper's own frames, and written to the file torchrun's agent reads
(``TORCHELASTIC_ERROR_FILE``), so ``modelparallel run`` can name the failing rank and
show its traceback without the script using ``@record``.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback


def _user_frames(error: BaseException, script: str):
    """The traceback from the first frame of the user's script on."""
    tb = error.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != script:
        tb = tb.tb_next
    return tb or error.__traceback__


def write_error_file(error: BaseException, formatted: str) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": f"{type(error).__name__}: {error}",
                        "extraInfo": {"py_callstack": formatted,
                                      "timestamp": str(int(time.time()))}}}
    with open(path, "w") as f:
        json.dump(data, f)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m modelparallel.launch.worker script.py [args...]")
    script = os.path.abspath(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as error:
        formatted = "".join(traceback.format_exception(
            type(error), error, _user_frames(error, script)))
        sys.stderr.write(formatted)
        sys.stderr.flush()
        write_error_file(error, formatted)
        sys.exit(1)


if __name__ == "__main__":
    main()
