"""A private jobs directory per test, and cleanup of every process its jobs started."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import processes_naming

from modelparallel.jobs import Estimator
from modelparallel.jobs.estimator import stop_job
from modelparallel.jobs.store import TERMINAL, JobStore

SCRIPTS = Path(__file__).parent / "job_scripts"


class Jobs:
    def __init__(self, root: Path):
        self.dir = root
        self.env = {**os.environ, "MODELPARALLEL_JOBS_DIR": str(root)}

    @property
    def store(self) -> JobStore:
        return JobStore(self.dir / "jobs.db")

    def estimator(self, entry_point: str, **kwargs) -> Estimator:
        kwargs.setdefault("source_dir", str(SCRIPTS))
        kwargs.setdefault("processes_per_host", 1)
        return Estimator(entry_point, jobs_dir=self.dir, **kwargs)

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "modelparallel", "jobs", *map(str, args)],
                              capture_output=True, text=True, timeout=timeout, env=self.env)

    def cleanup(self) -> list[int]:
        """Stop jobs still running, then kill any process that names this jobs
        directory; the pids that had to be killed."""
        if (self.dir / "jobs.db").exists():
            store = self.store
            running = [r["name"] for r in store.list() if r["status"] not in TERMINAL]
            for name in running:
                stop_job(store, name)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and any(
                    store.get(n)["status"] not in TERMINAL for n in running):
                time.sleep(0.5)
        deadline = time.monotonic() + 15  # runners record the end, then exit
        while processes_naming(str(self.dir)) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = processes_naming(str(self.dir))
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return left


@pytest.fixture
def jobs(tmp_path):
    j = Jobs(tmp_path / "jobs")
    yield j
    left = j.cleanup()
    assert not left, f"processes of the test's jobs were still running: {left}"
