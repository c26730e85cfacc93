"""A run directory belongs to one run.

The first launcher to use a directory writes ``owner.json`` into it (created
exclusively, so two launchers starting at once cannot both take it): the run's id, the
job it is part of, and its command. A later launcher continues that run in the directory
when it is the same run:

- its environment names the run: ``MP_RUN_ID`` equal to the directory's run id (what a
  restarted, requeued or resubmitted job passes on; workers see it too), or
- it is part of the same job with the same command (script name and arguments): the
  job is ``$SLURM_JOB_ID`` (the nodes of one SLURM job share it and a requeued job
  keeps it), else, on several nodes, the rendezvous (``--rdzv-id`` at
  ``--rdzv-endpoint``) that the nodes of one job meet at.

Any other run is refused with one line: its metrics, TensorBoard events, outcome and
report would be mixed with the first run's.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Protocol

from modelparallel.observe import run_output

OWNER_NAME = "owner.json"


class RunDirectoryError(Exception):
    """The run directory cannot be used (one line for the user)."""


class Launch(Protocol):
    script: str
    script_args: list[str]
    nnodes: int
    rdzv_endpoint: str | None
    rdzv_id: str


def job_of(opts: Launch) -> str | None:
    """What names the job this launcher is part of, if anything does."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm job {os.environ['SLURM_JOB_ID']}"
    if opts.nnodes > 1 and opts.rdzv_endpoint:
        return f"rendezvous {opts.rdzv_id} at {opts.rdzv_endpoint}"
    return None


def unwritable(path: Path, error: OSError) -> RunDirectoryError:
    """The one line for a run directory that cannot be made or written."""
    return RunDirectoryError(
        f"modelparallel run: cannot write the run directory {path}: "
        f"{error.strerror or error}; give --run-dir a directory you can write (or set "
        f"MODELPARALLEL_RUNS_DIR to one)")


def claim(path: Path, opts: Launch, fresh_id: str) -> tuple[str, bool]:
    """Take ``path`` for this run, or join the run that holds it: (the run id, whether
    an earlier launcher of the same run used the directory). Raises RunDirectoryError
    when another run holds it or it cannot be written."""
    mine = {"run_id": os.environ.get(run_output.RUN_ID) or fresh_id, "job": job_of(opts),
            "command": [Path(opts.script).name, *opts.script_args],
            "host": socket.gethostname(), "pid": os.getpid(), "started_at": time.time()}
    owner_file = path / OWNER_NAME
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not (path / run_output.CONFIG_NAME).is_file():  # no run from before owners
            with open(owner_file, "x") as f:
                json.dump(mine, f, indent=2)
            return str(mine["run_id"]), False
    except FileExistsError:
        pass
    except OSError as e:
        raise unwritable(path, e) from e
    owner = _owner(path)
    named = bool(os.environ.get(run_output.RUN_ID)) and mine["run_id"] == owner.get("run_id")
    same_job = owner.get("job") is not None and owner.get("job") == mine["job"] and \
        owner.get("command") == mine["command"]
    if named or same_job:
        return str(owner["run_id"]), True
    started = owner.get("started_at")
    when = time.strftime(" %Y-%m-%d %H:%M:%S", time.localtime(started)) \
        if isinstance(started, (int, float)) else ""
    command = " ".join(map(str, owner.get("command") or [])) or "another command"
    raise RunDirectoryError(
        f"modelparallel run: {path} holds another run ({owner.get('run_id')}, started"
        f"{when} as `{command}`): give this run a --run-dir of its own (or remove that "
        f"one); to continue that run there, set MP_RUN_ID={owner.get('run_id')}")


def _owner(path: Path, wait_s: float = 2.0) -> dict[str, Any]:
    """The owner record (a launcher that just created it may still be writing it), or
    for a directory from before owner records, its config.json's run id."""
    deadline = time.monotonic() + wait_s
    while True:
        for name in (OWNER_NAME, run_output.CONFIG_NAME):
            try:
                data = json.loads((path / name).read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and data.get("run_id"):
                if name == run_output.CONFIG_NAME:
                    launch = data.get("launch") or {}
                    data = {"run_id": data["run_id"], "job": None,
                            "started_at": data.get("started_at"),
                            "command": [Path(str(launch.get("script", "?"))).name,
                                        *launch.get("script_args", [])]}
                return data
        if time.monotonic() > deadline:
            return {"run_id": path.name, "job": None}
        time.sleep(0.1)
