"""What a run leaves in its run directory from inside the workers (rank 0 only).

``modelparallel run`` makes a run directory and exports it as ``MP_RUN_DIR`` (with
``MP_RUN_ID`` naming the run); ``modelparallel.launch.run_dir`` writes the launcher's
part (``config.json``, the logs, ``outcome.json``, ``report.html``). Here is the
workers' part:

- ``metrics.jsonl``: one JSON line per step from ``StepMetrics``, each with the run id
  and the restart attempt, so lines of different runs or attempts are never confused;
- ``layout.json``: the configuration as the script ran it, and the topology;
- TensorBoard event files (``tensorboard --logdir runs/`` shows every run);
- ``schedule.json``: the pipeline schedules recorded with ``model.record_schedule()``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelparallel.observe.progress import Progress

if TYPE_CHECKING:
    from modelparallel.context import ParallelContext
    from modelparallel.observe.metrics import StepRecord
    from modelparallel.parallel.pipeline.record import ScheduleRecording

logger = logging.getLogger(__name__)

RUN_DIR = "MP_RUN_DIR"  # set by modelparallel run for its workers
RUN_ID = "MP_RUN_ID"
METRICS_FILE = "MP_METRICS_FILE"  # set by a training job: inside the job's run directory
METRICS_NAME = "metrics.jsonl"
LAYOUT_NAME = "layout.json"
SCHEDULE_NAME = "schedule.json"
CONFIG_NAME = "config.json"  # the launcher's files (modelparallel.launch.run_dir)
OUTCOME_NAME = "outcome.json"
REPORT_NAME = "report.html"
MiB = 2**20


def run_dir_from_env() -> Path | None:
    """The launcher's run directory (``MP_RUN_DIR``), or None outside ``modelparallel run``."""
    value = os.environ.get(RUN_DIR)
    return Path(value) if value else None


def run_id() -> str:
    """The launcher's run id, or one made from the time and process id (plain python)."""
    return os.environ.get(RUN_ID) or time.strftime("%Y-%m-%d_%H%M%S") + f"-pid{os.getpid()}"


def _same(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


class RunOutput:
    """Rank 0's writer for ``StepMetrics``: JSON lines, ``layout.json``, TensorBoard
    scalars, the printed lines and the progress bar.

    ``jsonl`` is the file asked for (``jsonl=`` or a job's ``MP_METRICS_FILE``);
    ``run_dir`` the run directory (``run_dir=`` or ``MP_RUN_DIR``). Lines go to both
    (once when they are the same file). ``tensorboard``: None writes events when there is
    a run directory and the ``tensorboard`` package is installed (one log line
    otherwise); True requires both; False writes none.
    """

    def __init__(self, ctx: ParallelContext, *, jsonl: Path | None, run_dir: Path | None,
                 tensorboard: bool | None, total_steps: int | None, print_every: int,
                 printer: Callable[[str], None] | None):
        self.run = run_id()
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.run_dir = run_dir
        self.paths = [p for p in (jsonl, run_dir / METRICS_NAME if run_dir else None) if p]
        if len(self.paths) == 2 and _same(*self.paths):
            self.paths = self.paths[:1]
        self.print_every = print_every
        self.printer = printer or (lambda line: print(line, file=sys.stdout, flush=True))
        self.progress = (Progress(total_steps, sys.stdout if printer is None else None)
                         if total_steps is not None else None)
        self.writer = self._tensorboard(tensorboard)
        self._flushed = time.monotonic()
        if run_dir is not None:
            write_layout(run_dir / LAYOUT_NAME, ctx)
        atexit.register(self.close)

    def _tensorboard(self, wanted: bool | None) -> Any:
        if wanted is False:
            return None
        if self.run_dir is None:
            if wanted:
                raise ValueError("StepMetrics(tensorboard=True) needs a run directory: run "
                                 "under `modelparallel run` or pass run_dir=")
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch's writer needs the tensorboard package
            if wanted:
                raise ImportError("StepMetrics(tensorboard=True) needs the tensorboard "
                                  "package: pip install 'modelparallel[tensorboard]'") from e
            logger.warning("StepMetrics: no TensorBoard events in %s (the tensorboard package "
                           "is not installed: pip install 'modelparallel[tensorboard]'); "
                           "metrics.jsonl and report.html are written all the same",
                           self.run_dir)
            return None
        return SummaryWriter(log_dir=str(self.run_dir), flush_secs=10)

    def write(self, rec: StepRecord) -> None:
        """Print (every ``print_every`` steps), advance the bar, append the JSON line and
        the TensorBoard scalars of one step."""
        if self.progress is not None:
            self.progress.advance(rec.step_time_s)
        if rec.step % self.print_every == 0 or rec.step == 1:
            self._print(rec.format())
        line = json.dumps({"run": self.run, "attempt": self.attempt, "time": time.time(),
                           **asdict(rec)})
        for path in self.paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.write(line + "\n")
        if self.writer is not None:
            self._scalars(rec)

    def _print(self, line: str) -> None:
        p = self.progress
        if p is not None and p.owns_lines and p.bar is not None:
            p.write(line)  # through the bar, which is redrawn below it
        else:
            self.printer(line + (p.suffix() if p is not None else ""))

    def _scalars(self, rec: StepRecord) -> None:
        w, step = self.writer, rec.step
        if rec.loss is not None:
            w.add_scalar("loss", rec.loss, step)
        w.add_scalar("step_time_ms", rec.step_time_s * 1e3, step)
        w.add_scalar("throughput/samples_per_s", rec.samples_per_s, step)
        if rec.tokens_per_s is not None:
            w.add_scalar("throughput/tokens_per_s", rec.tokens_per_s, step)
        # one series per kind of measure; the steps StepMetrics did not measure ("tensors,
        # max of steps 1-3", "none") add no point: a gap, not a flat line
        if "," not in rec.memory_kind and rec.memory_kind != "none":
            w.add_scalar(f"memory/peak_{rec.memory_kind}_MiB", rec.peak_memory_bytes / MiB, step)
        for group, nbytes in rec.comm_bytes.items():
            w.add_scalar(f"comm_MiB/{group}", nbytes / MiB, step)
        if time.monotonic() - self._flushed > 1.0:  # visible in TensorBoard while it runs
            w.flush()
            self._flushed = time.monotonic()

    def close(self) -> None:
        """Finish the bar and flush the TensorBoard events (also at exit)."""
        if self.progress is not None:
            self.progress.close()
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def write_layout(path: Path, ctx: ParallelContext) -> None:
    """The configuration as the script ran it (all keys, and which were set) and the
    topology, for the report."""
    topo = ctx.topology
    data = {"config": ctx.config.to_dict(), "explicit": sorted(ctx.config.explicit),
            "topology": {"describe": topo.describe(), "world_size": topo.world_size,
                         "order": topo.order,
                         "dims": {d: topo.dim_size(d) for d in topo.dim_names}},
            "device": str(ctx.device)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))


def write_schedule(recording: ScheduleRecording, rank: int,
                   run_dir: Path | None = None) -> Path | None:
    """Rank 0 appends a recorded pipeline schedule to ``schedule.json`` in the run
    directory (``MP_RUN_DIR`` unless given); the report draws the last one. Nothing is
    written on other ranks or without a run directory."""
    run_dir = run_dir or run_dir_from_env()
    if rank != 0 or run_dir is None or not recording.events:
        return None
    path = run_dir / SCHEDULE_NAME
    recorded = json.loads(path.read_text()) if path.is_file() else []
    recorded.append({"ranks": recording.ranks, "microbatches": recording.microbatches,
                     "virtual": recording.virtual, "bubble": recording.bubble,
                     "theoretical": recording.theoretical,
                     "events": [asdict(e) for e in recording.events]})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(recorded))
    return path
