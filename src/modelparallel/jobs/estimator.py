"""``Estimator``: describe a training job in a few lines, ``fit()`` it, get the model."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from modelparallel.jobs.backends import JobContext, backend_class
from modelparallel.jobs.channels import TrainingInput, is_private, stage
from modelparallel.jobs.follow import FollowedFile
from modelparallel.jobs.layout import JobLayout
from modelparallel.jobs.spec import JobError, JobSpec, build_spec
from modelparallel.jobs.store import TERMINAL, JobStore, default_jobs_dir


class JobFailed(RuntimeError):
    """``fit()`` waited for a job that ended Failed or Stopped; ``job`` tells more."""

    def __init__(self, job: TrainingJob):
        self.job = job
        record = job.describe()
        super().__init__(f"training job {job.name} ended {record['secondary_status']}: "
                         f"{record.get('failure_reason') or 'no reason recorded'}")


class TrainingJob:
    """A submitted job, read from the job store (``Estimator.latest_job``)."""

    def __init__(self, name: str, jobs_dir: str | os.PathLike | None = None):
        self.name = name
        self.jobs_dir = Path(jobs_dir) if jobs_dir else default_jobs_dir()
        self.store = JobStore(self.jobs_dir / "jobs.db")
        if self.store.get(name) is None:
            raise LookupError(f"no training job named {name!r} in {self.jobs_dir}")

    def describe(self) -> dict[str, Any]:
        """The store's record: status, transitions, exit codes, artifacts, ..."""
        record = check_runner(self.store, self.name)
        record["transitions"] = self.store.transitions(self.name)
        return record

    @property
    def status(self) -> str:
        """InProgress, Stopping, Completed, Failed or Stopped."""
        return self.describe()["status"]

    @property
    def failure_reason(self) -> str | None:
        return self.describe()["failure_reason"]

    @property
    def model_artifact(self) -> str | None:
        """The URI of model.tar.gz once the job completed."""
        return self.describe()["model_uri"]

    @property
    def metrics(self) -> dict[str, list[float]]:
        """Every metric's values this attempt, in the order they were recorded."""
        record = self.store.require(self.name)
        out: dict[str, list[float]] = {}
        for row in self.store.metrics(self.name, record["attempt"]):
            out.setdefault(row["metric"], []).append(row["value"])
        return out

    @property
    def log_path(self) -> Path:
        return JobLayout(self.store.require(self.name)["job_dir"]).log

    def wait(self, logs: bool = True, poll_s: float = 0.3) -> str:
        """Wait until the job ends (printing its log if ``logs``); its final status."""
        for line in follow_log(self, from_start=False, follow=True, poll_s=poll_s):
            if logs:
                print(line, end="", flush=True)
        return self.status

    def stop(self) -> str:
        """Ask the job to stop; returns the status it is in now."""
        return stop_job(self.store, self.name)

    def __repr__(self) -> str:
        return f"TrainingJob({self.name!r}, status={self.status!r})"


class Estimator:
    """A training job description, as SageMaker's PyTorch estimator.

    ``fit(inputs)`` starts the job (``inputs``: a path/URL or ``{"train": path_or_url
    or TrainingInput, ...}``), waits for it and prints its log by default, and raises
    ``JobFailed`` if it does not complete. ``model_data`` is then the model archive.
    Extra keywords: ``backend_options`` (for ray/slurm/kubernetes) and ``jobs_dir``
    (the store and job directories; default ``$MODELPARALLEL_JOBS_DIR`` or the user's
    data directory).
    """

    def __init__(self, entry_point: str, source_dir: str | None = None,
                 instance_count: int = 1, processes_per_host: int | None = None,
                 hyperparameters: Mapping[str, Any] | None = None,
                 distribution: Mapping[str, Any] | None = None,
                 output_path: str | None = None, checkpoint_uri: str | None = None,
                 environment: Mapping[str, str] | None = None, max_run: float | None = None,
                 max_restarts: int = 0,
                 metric_definitions: list[Mapping[str, str]] | None = None,
                 backend: str = "local", job_name: str | None = None, *,
                 backend_options: Mapping[str, Any] | None = None,
                 jobs_dir: str | os.PathLike | None = None):
        self.kwargs = dict(entry_point=entry_point, source_dir=source_dir,
                           instance_count=instance_count,
                           processes_per_host=processes_per_host,
                           hyperparameters=dict(hyperparameters or {}),
                           distribution=_plain(distribution), output_path=output_path,
                           checkpoint_uri=checkpoint_uri, environment=environment,
                           max_run=max_run, max_restarts=max_restarts,
                           metric_definitions=[dict(m) for m in metric_definitions or []],
                           backend=backend, backend_options=dict(backend_options or {}))
        self.job_name = job_name
        self.jobs_dir = Path(jobs_dir).resolve() if jobs_dir else default_jobs_dir()
        self.latest_job: TrainingJob | None = None

    def prepare(self, inputs: Any = None, job_name: str | None = None, *,
                to_run: bool = True) -> JobSpec:
        """Check everything (with ``to_run``, also that this machine has what the
        backend runs) and return the job's description; nothing starts."""
        name = job_name or self.job_name or _unique_name(self.kwargs["entry_point"])
        output_path = self.kwargs["output_path"] or str(self.jobs_dir)
        spec = build_spec(**{**self.kwargs, "output_path": output_path}, inputs=inputs,
                          name=name)
        backend = backend_class(spec.backend)
        problems = backend.check(spec) + (backend.missing_tools() if to_run else [])
        if problems:
            raise JobError(problems)
        return spec

    def render(self, inputs: Any = None, job_name: str | None = None) -> str:
        """What the backend would run (sbatch script, manifest, commands)."""
        spec = self.prepare(inputs, job_name, to_run=False)
        layout = JobLayout(self.jobs_dir / spec.name)
        backend = backend_class(spec.backend)(spec.backend_options)
        return backend.render(JobContext(spec, layout, attempt=1))

    def fit(self, inputs: Any = None, wait: bool = True, logs: bool = True,
            job_name: str | None = None) -> TrainingJob:
        """Start the job; with ``wait``, follow it to the end and raise ``JobFailed``
        unless it completed. The name of an ended job resumes it (a new attempt with
        its checkpoints restored)."""
        spec = self.prepare(inputs, job_name)
        job = submit(spec, self.jobs_dir)
        self.latest_job = job
        if wait:
            try:
                status = job.wait(logs=logs)
            except KeyboardInterrupt:
                print(f"\njob {job.name} keeps running; `modelparallel jobs stop "
                      f"{job.name}` stops it", file=sys.stderr)
                raise
            if status != "Completed":
                raise JobFailed(job)
        return job

    @property
    def model_data(self) -> str | None:
        """The latest job's model.tar.gz URI (None until a job completed)."""
        return self.latest_job.model_artifact if self.latest_job else None


def submit(spec: JobSpec, jobs_dir: Path) -> TrainingJob:
    """Record the job, snapshot its code, stage private channels, start its runner."""
    store = JobStore(jobs_dir / "jobs.db")
    layout = JobLayout(jobs_dir / spec.name)
    attempt = store.begin(spec.name, spec=json.loads(spec.to_json()),
                          job_dir=str(layout.root), backend=spec.backend,
                          checkpoint_uri=spec.checkpoint_uri)
    try:
        layout.create()
        snapshot_code(spec, layout)
        for name, channel in list(spec.inputs.items()):
            if is_private(channel.uri):
                spec.inputs[name] = stage(channel, layout.staged(name))
        layout.spec.write_text(spec.to_json())
    except Exception as e:
        reason = f"preparing the job failed: {type(e).__name__}: {e}"
        store.update(spec.name, failure_reason=reason)
        store.transition(spec.name, "Failed", reason)
        raise
    with layout.log.open("a") as log:
        log.write(f"[modelparallel] ===== attempt {attempt} =====\n")
    runner_log = (layout.root / "runner.log").open("ab")
    proc = subprocess.Popen([sys.executable, "-m", "modelparallel.jobs.runner",
                             str(layout.root), "--db", str(store.path)],
                            stdin=subprocess.DEVNULL, stdout=runner_log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    runner_log.close()
    store.update(spec.name, runner_pid=proc.pid, runner_host=socket.gethostname())
    return TrainingJob(spec.name, jobs_dir)


def snapshot_code(spec: JobSpec, layout: JobLayout) -> None:
    """Copy the source directory (or the entry point alone) into the job directory, as
    SageMaker uploads it: instances run this copy, and later edits do not reach them."""
    code = layout.code
    shutil.rmtree(code, ignore_errors=True)
    if spec.source_dir:
        shutil.copytree(spec.source_dir, code,
                        ignore=shutil.ignore_patterns(".git", "__pycache__", "*.pyc"))
    else:
        code.mkdir(parents=True)
        shutil.copy2(spec.entry_point, code / Path(spec.entry_point).name)
        spec.entry_point = Path(spec.entry_point).name
    spec.source_dir = str(code)


def follow_log(job: TrainingJob, *, from_start: bool, follow: bool, poll_s: float = 0.3):
    """Yield the job's log lines (this attempt's, unless ``from_start``), until it ends."""
    path = job.log_path
    log = FollowedFile(path, 0 if from_start else _attempt_offset(path))
    while True:
        ended = check_runner(job.store, job.name)["status"] in TERMINAL
        for raw in log.read_new().splitlines(keepends=True):
            yield raw.decode(errors="replace")
        if ended or not follow:
            return
        time.sleep(poll_s)


def _attempt_offset(path: Path) -> int:
    """Where the newest attempt's lines begin."""
    if not path.is_file():
        return 0
    data = path.read_bytes()
    return max(0, data.rfind(b"[modelparallel] ===== attempt "))


def check_runner(store: JobStore, name: str) -> dict[str, Any]:
    """The job's record; a job whose runner process is gone without recording an end
    (killed, machine rebooted) is recorded as Failed."""
    record = store.get(name)
    if record is None:
        raise LookupError(f"no training job named {name!r}")
    if record["status"] in TERMINAL or record["runner_host"] != socket.gethostname():
        return record
    pid = record["runner_pid"]
    if pid and not _alive(pid):
        time.sleep(0.5)  # the runner may have recorded its end just now
        record = store.require(name)
        if record["status"] not in TERMINAL:
            reason = (f"the job's runner process (pid {pid}) ended without recording how "
                      f"the job ended; see {record['job_dir']}/runner.log")
            store.update(name, failure_reason=reason)
            store.transition(name, "Failed", reason)
            record = store.require(name)
    return record


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of this process has ended too
        waited, _ = os.waitpid(pid, os.WNOHANG)
        return waited == 0
    except ChildProcessError:
        return True


def stop_job(store: JobStore, name: str) -> str:
    """Send the job's runner SIGTERM (it stops the instances and records Stopped)."""
    record = check_runner(store, name)
    if record["status"] in TERMINAL:
        return record["status"]
    if record["runner_host"] != socket.gethostname():
        raise RuntimeError(f"job {name} is run from host {record['runner_host']}; stop it "
                           f"there")
    store.transition(name, "Stopping", "stop requested")
    with contextlib.suppress(ProcessLookupError):
        os.kill(record["runner_pid"], signal.SIGTERM)
    return check_runner(store, name)["status"]


def _unique_name(entry_point: Any) -> str:
    base = re.sub(r"[^a-zA-Z0-9]+", "-", Path(str(entry_point or "job")).stem).strip("-")
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H-%M-%S-%f")[:-3]
    return f"{(base or 'job')[:32]}-{stamp}"


def _plain(value: Any) -> Any:
    """Mappings as plain dicts (JSON-able)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


__all__ = ["Estimator", "JobFailed", "TrainingInput", "TrainingJob"]
