"""Where a job keeps its files: one directory per job under the jobs directory.

::

    JOB/spec.json                      the checked JobSpec
    JOB/job.log                        every instance's output, lines prefixed [algo-N]
    JOB/code/                          the source directory, copied at submit
    JOB/checkpoints/                   MP_CHECKPOINT_DIR, shared by every rank
    JOB/staged/CHANNEL/                memory:// channels copied at submit
    JOB/instances/algo-N/code/         the instance's copy: its working directory
    JOB/instances/algo-N/input/data/CHANNEL/   File-mode channels
    JOB/instances/algo-N/model/        MP_MODEL_DIR (packed as model.tar.gz)
    JOB/instances/algo-N/output/       MP_OUTPUT_DIR (failure file), data/ = MP_OUTPUT_DATA_DIR
    JOB/instances/algo-N/run/          the instance's run directory (modelparallel run's:
                                       config, logs, report.html), MP_RUN_DIR
    JOB/instances/algo-N/run/metrics.jsonl  the library's per-step metrics (rank 0)
    JOB/instances/algo-N/result.json   exit code, failure reason, artifact URIs

The job directory must be on a filesystem every instance reaches (one machine, or the
shared filesystem of a SLURM or Ray cluster). It is private to its user (mode 0700).
"""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_DIR = 0o700  # job directories hold code, data and logs: their user's alone


class JobLayout:
    def __init__(self, job_dir: str | os.PathLike):
        self.root = Path(job_dir)

    def create(self) -> None:
        """Make the job directory, readable by its user only (also an existing one)."""
        self.root.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
        os.chmod(self.root, PRIVATE_DIR)  # mkdir's mode is masked by the umask

    @property
    def spec(self) -> Path:
        return self.root / "spec.json"

    @property
    def log(self) -> Path:
        return self.root / "job.log"

    @property
    def code(self) -> Path:
        return self.root / "code"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def staged(self, channel: str) -> Path:
        return self.root / "staged" / channel

    def instance(self, index: int) -> Path:
        return self.root / "instances" / f"algo-{index + 1}"

    def result(self, index: int) -> Path:
        return self.instance(index) / "result.json"

    def run_dir(self, index: int) -> Path:
        """The instance's run directory (``modelparallel run --run-dir``); the first
        instance's is the job's (``modelparallel jobs list`` shows it)."""
        return self.instance(index) / "run"

    def metrics(self, index: int) -> Path:
        return self.run_dir(index) / "metrics.jsonl"
