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
    JOB/instances/algo-N/metrics.jsonl the library's per-step metrics (rank 0)
    JOB/instances/algo-N/result.json   exit code, failure reason, artifact URIs

The job directory must be on a filesystem every instance reaches (one machine, or the
shared filesystem of a SLURM or Ray cluster).
"""

from __future__ import annotations

import os
from pathlib import Path


class JobLayout:
    def __init__(self, job_dir: str | os.PathLike):
        self.root = Path(job_dir)

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

    def metrics(self, index: int) -> Path:
        return self.instance(index) / "metrics.jsonl"
