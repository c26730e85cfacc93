"""The run directory of ``modelparallel run``: one per run, everything about it in one place.

::

    runs/2026-11-26_171503-train/   (or --run-dir DIR; the base: $MODELPARALLEL_RUNS_DIR)
      owner.json       the run the directory belongs to (run_owner.py)
      config.json      the launch options and the configuration (--config / MP_CONFIG)
                       resolved with the defaults
      logs/            each rank's stdout/stderr (torchrun's --log-dir layout)
      metrics.jsonl    StepMetrics' lines (rank 0), layout.json, TensorBoard events,
      layout.json      schedule.json: written by the workers
      outcome.json     exit code, failure summary, start, end
      report.html      one self-contained page about the run (modelparallel report DIR)

The launcher exports the directory to the workers as ``MP_RUN_DIR`` (and ``MP_RUN_ID``;
``MP_PROGRESS_TTY`` when its output is a terminal, for the progress bar), prints its path
at the start and the end, and writes the report at the end of every run, failed ones
included.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from modelparallel.config import Config, normalise
from modelparallel.config_files import read_config_file, read_launcher_config
from modelparallel.errors import ConfigError
from modelparallel.launch.run_owner import RunDirectoryError, claim, unwritable
from modelparallel.observe import run_output
from modelparallel.observe.progress import PROGRESS_TTY
from modelparallel.topology import check_world
from modelparallel.version import __version__

RUNS_DIR = "MODELPARALLEL_RUNS_DIR"  # where default run directories are made
CONFIG_NAME, OUTCOME_NAME = run_output.CONFIG_NAME, run_output.OUTCOME_NAME


class LaunchOptions(Protocol):
    """What of ``RunOptions`` the run directory reads (``modelparallel.launch.run``)."""

    script: str
    script_args: list[str]
    nproc_per_node: int | None
    nnodes: int
    node_rank: int | None
    rdzv_endpoint: str | None
    rdzv_id: str
    config: str | None
    max_restarts: int
    log_dir: str | None
    compat: str | None
    run_dir: str | None


Options = TypeVar("Options", bound=LaunchOptions)
Launch = Callable[[Options], tuple[int, str | None]]


def default_runs_dir() -> Path:
    """``$MODELPARALLEL_RUNS_DIR``, else ``runs/`` in the current directory."""
    return Path(os.environ.get(RUNS_DIR) or "runs")


def new_run_dir(base: Path, name: str, now: float | None = None) -> Path:
    """A new directory ``base/YYYY-MM-DD_HHMMSS-name``; ``-2``, ``-3``, ... is added when
    another run took that name in the same second (mkdir is atomic: two launchers never
    share one)."""
    stamp = time.strftime("%Y-%m-%d_%H%M%S", time.localtime(now))
    base.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        path = base / (f"{stamp}-{name}" + (f"-{n}" if n > 1 else ""))
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free run directory name for {stamp}-{name} in {base}")


def launch_config(opts: LaunchOptions, world_size: int) -> tuple[dict[str, Any], Config]:
    """The keys the launcher passes to the workers (the ``--config`` file, else an
    ``MP_CONFIG`` already set) and that configuration checked for ``world_size``."""
    if opts.config is not None:
        explicit = normalise(read_config_file(opts.config), origin=str(opts.config))
    else:
        explicit = normalise(read_launcher_config(os.environ), origin="MP_CONFIG")
    config = Config.load(explicit, environ={})
    check_world(config, world_size)
    return explicit, config


def _shown(path: Path) -> str:
    """``path`` relative to the current directory when it is below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


class RunDirectory:
    """One run's directory: made (or reused) at the start, completed at the end."""

    def __init__(self, path: Path):
        self.path = path.resolve()
        self.id = self.path.name
        self.started = time.time()

    @classmethod
    def open(cls, opts: LaunchOptions) -> RunDirectory:
        """The run's directory: ``--run-dir`` (taken for this run, or continued when this
        is the run that holds it: run_owner.py), else a new dated one."""
        try:
            path = Path(opts.run_dir) if opts.run_dir else \
                new_run_dir(default_runs_dir(), Path(opts.script).stem)
        except OSError as e:
            raise unwritable(default_runs_dir(), e) from e
        run = cls(path)
        run.id, continued = claim(run.path, opts, fresh_id=run.path.name)
        if continued:
            print(f"modelparallel run: continuing run {run.id} in {_shown(run.path)}",
                  file=sys.stderr, flush=True)
        return run

    def write_config(self, opts: LaunchOptions, nproc: int, explicit: dict[str, Any],
                     config: Config) -> None:
        launch = {"script": opts.script, "script_args": list(opts.script_args),
                  "nproc_per_node": nproc, "nnodes": opts.nnodes,
                  "world_size": nproc * opts.nnodes, "node_rank": opts.node_rank,
                  "rdzv_endpoint": opts.rdzv_endpoint, "config_file": opts.config,
                  "max_restarts": opts.max_restarts, "log_dir": opts.log_dir,
                  "compat": opts.compat}
        data = {"run_id": self.id, "started_at": self.started, "host": socket.gethostname(),
                "cwd": os.getcwd(), "command": sys.argv, "versions": {
                    "modelparallel": __version__, "torch": torch.__version__,
                    "python": sys.version.split()[0]},
                "launch": launch, "config_explicit": explicit, "config": config.to_dict()}
        (self.path / CONFIG_NAME).write_text(json.dumps(data, indent=2, default=str))

    @contextmanager
    def exported(self) -> Iterator[None]:
        """``MP_RUN_DIR``, ``MP_RUN_ID`` and ``MP_PROGRESS_TTY`` for the workers while they
        run (torchrun passes the launcher's environment on), as they were afterwards."""
        values = {run_output.RUN_DIR: str(self.path), run_output.RUN_ID: self.id}
        tty = _terminal()
        if tty:
            values[PROGRESS_TTY] = tty
        saved = {k: os.environ.get(k) for k in (*values, PROGRESS_TTY)}
        os.environ.pop(PROGRESS_TTY, None)
        os.environ.update(values)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def finish(self, code: int | None, summary: str | None) -> None:
        """Record the outcome and write the report (a report that cannot be written is
        one line, never a different exit code)."""
        outcome = {"run_id": self.id, "exit_code": code, "summary": summary,
                   "started_at": self.started, "ended_at": time.time()}
        (self.path / OUTCOME_NAME).write_text(json.dumps(outcome, indent=2))
        try:
            from modelparallel.observe.report import write_report

            report = write_report(self.path)
            print(f"modelparallel run: run directory {_shown(self.path)} (report: "
                  f"{_shown(report)})", file=sys.stderr, flush=True)
        except Exception as e:
            print(f"modelparallel run: run directory {_shown(self.path)}; report.html could "
                  f"not be written: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def _terminal() -> str | None:
    """The launcher's terminal, when its standard output is one."""
    try:
        return os.ttyname(sys.stdout.fileno()) if sys.stdout.isatty() else None
    except (AttributeError, OSError, ValueError):  # replaced or closed stdout
        return None


def keep_run_directory(default_nproc: Callable[[], int]) -> Callable[[Launch], Launch]:
    """Decorates ``run_workers``: the run gets its directory, its logs go there (unless
    ``--log-dir``), the workers learn where it is, and the outcome and report are written
    when it ends, however it ends. A command refused before anything starts (no script,
    an invalid configuration) gets no directory: the launcher reports it as before."""

    def decorate(launch: Launch) -> Launch:
        @functools.wraps(launch)
        def wrapper(opts: Options) -> tuple[int, str | None]:
            if not Path(opts.script).is_file() or (opts.nnodes > 1 and
                                                   opts.rdzv_endpoint is None):
                return launch(opts)
            nproc = opts.nproc_per_node or default_nproc()
            try:
                explicit, config = launch_config(opts, opts.nnodes * nproc)
            except ConfigError:
                return launch(opts)  # which raises it, as without a run directory
            try:
                run = RunDirectory.open(opts)
                try:
                    run.write_config(opts, nproc, explicit, config)
                except OSError as e:
                    raise unwritable(run.path, e) from e
            except RunDirectoryError as e:
                print(e, file=sys.stderr, flush=True)
                return 2, str(e)
            print(f"modelparallel run: run directory {_shown(run.path)}", file=sys.stderr,
                  flush=True)
            opts = copy.copy(opts)
            opts.log_dir = opts.log_dir or str(run.path / "logs")
            with run.exported():
                try:
                    code, summary = launch(opts)
                except BaseException as e:  # interrupted, stopped, or a launcher error
                    run.finish(None, f"{type(e).__name__}: {e}")
                    raise
            run.finish(code, summary)
            return code, summary

        return wrapper

    return decorate
