"""Error paths of jobs that need no running job: a runner that died, a backend whose
commands are missing, stopping a job run from another host."""

import socket
import subprocess

import pytest

from modelparallel.jobs import Estimator, JobError
from modelparallel.jobs.estimator import check_runner, stop_job
from modelparallel.jobs.store import JobStore

SPEC = {"instance_count": 1, "processes_per_host": 1, "hyperparameters": {}}


def test_a_job_whose_runner_died_is_recorded_failed(tmp_path):
    store = JobStore(tmp_path / "jobs.db")
    store.begin("orphan", spec=SPEC, job_dir=str(tmp_path / "orphan"), backend="local",
                checkpoint_uri=None)
    gone = subprocess.Popen(["true"])
    gone.wait()
    store.update("orphan", runner_pid=gone.pid, runner_host=socket.gethostname())
    record = check_runner(store, "orphan")
    assert record["status"] == "Failed"
    assert record["failure_reason"] == (
        f"the job's runner process (pid {gone.pid}) ended without recording how the job "
        f"ended; see {tmp_path / 'orphan'}/runner.log")


def test_stopping_a_job_run_from_another_host(tmp_path):
    store = JobStore(tmp_path / "jobs.db")
    store.begin("far", spec=SPEC, job_dir=str(tmp_path / "far"), backend="slurm",
                checkpoint_uri=None)
    store.update("far", runner_pid=1, runner_host="login-node-7")
    with pytest.raises(RuntimeError, match="job far is run from host login-node-7; stop it "
                                           "there"):
        stop_job(store, "far")
    assert store.get("far")["status"] == "InProgress"


def test_missing_backend_commands_are_named_before_anything_starts(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    est = Estimator("train.py", source_dir=str(tmp_path), processes_per_host=1,
                    backend="slurm", jobs_dir=tmp_path / "jobs")
    with pytest.raises(JobError) as e:
        est.fit(wait=False)
    assert e.value.problems == [
        ("backend", f"the slurm backend needs `{tool}` on PATH (SLURM's client commands)")
        for tool in ("sbatch", "scontrol", "scancel")]
    assert "#SBATCH --nodes=1" in est.render()  # a dry run needs none of them
    assert not (tmp_path / "jobs" / "jobs.db").exists()
