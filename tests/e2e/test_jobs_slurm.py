"""The slurm backend: the generated batch script on its own, then real jobs on a
two-node SLURM cluster (node1 on 127.0.0.2, node2 on 127.0.0.3) started by the fixture."""

from __future__ import annotations

import subprocess
import time

import pytest
from procs import cmdline
from slurm_cluster import skip_reason, slurm_fixture  # noqa: F401
from test_jobs_local import data_dir
from test_jobs_vit import check_vit_job, digits  # noqa: F401

from modelparallel.jobs.backends import JobContext
from modelparallel.jobs.backends.slurm import SlurmBackend
from modelparallel.jobs.layout import JobLayout


def test_batch_script(jobs, tmp_path):
    (tmp_path / "data").mkdir()
    spec = jobs.estimator("contract.py", instance_count=3, max_run=90, backend="slurm",
                          backend_options={"partition": "gpu", "account": "ml",
                                           "sbatch_args": ["--gres=gpu:8"]},
                          job_name="scripted").prepare({"train": str(tmp_path / "data")},
                                                       to_run=False)  # no sbatch needed
    script = SlurmBackend(spec.backend_options).render(
        JobContext(spec, JobLayout(jobs.dir / spec.name), attempt=2))
    for line in ("#SBATCH --job-name=scripted", "#SBATCH --nodes=3",
                 "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=gpu",
                 "#SBATCH --account=ml", "#SBATCH --time=2", "#SBATCH --gres=gpu:8",
                 f"#SBATCH --output={jobs.dir / 'scripted'}/slurm-%j.out"):
        assert line in script.splitlines(), line
    assert "srun --kill-on-bad-exit=1 --ntasks-per-node=1" in script
    assert "--rdzv-id scripted-2" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    # a dry run needs no SLURM commands on this machine
    shown = jobs.cli("submit", "--dry-run", _job_file(tmp_path))
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("#!/bin/bash\n#SBATCH --job-name=from-file")


def _job_file(tmp_path):
    from jobs_fixture import SCRIPTS

    path = tmp_path / "job.yaml"
    path.write_text(f"entry_point: contract.py\nsource_dir: {SCRIPTS}\njob_name: from-file\n"
                    f"instance_count: 2\nprocesses_per_host: 1\nbackend: slurm\n")
    return path


needs_slurm = pytest.mark.skipif(bool(skip_reason()), reason=skip_reason() or "")


@needs_slurm
@pytest.mark.timeout(400)
def test_vit_job_on_two_slurm_nodes(jobs, slurm, digits, monkeypatch):  # noqa: F811
    from run_jobs import digits_channels, vit_estimator

    slurm.use_in(monkeypatch)  # the runner finds the cluster through SLURM_CONF
    est = vit_estimator("hybrid-tp", epochs=2, backend="slurm", jobs_dir=jobs.dir)
    est.fit(digits_channels(digits), logs=False)
    check_vit_job(est, digits)
    record = est.latest_job.describe()
    assert record["backend_info"]["slurm_job_id"]
    log = est.latest_job.log_path.read_text()
    assert "(127.0.0.2 127.0.0.3 ), rendezvous 127.0.0.2:" in log
    assert "[algo-2] [modelparallel] algo-2: finished with exit code 0" in log


@needs_slurm
@pytest.mark.extended  # long fault test
@pytest.mark.timeout(300)
def test_slurm_failure_and_stop(jobs, slurm, monkeypatch, tmp_path):
    slurm.use_in(monkeypatch)
    data = str(data_dir(tmp_path / "d", 2))
    failing = jobs.estimator("contract.py", instance_count=2, backend="slurm",
                             job_name="fails", hyperparameters={"epochs": 1,
                                                                "fail": "file"})
    slow = jobs.estimator("contract.py", instance_count=2, backend="slurm", job_name="slow",
                          hyperparameters={"epochs": 1000, "sleep": 0.2})
    job = failing.fit({"train": data}, wait=False)
    job.wait(logs=False)
    record = job.describe()
    assert record["status"] == "Failed"
    assert record["failure_reason"] == \
        "algo-2 exited with 3: CustomError: the data was bad\nsecond line"

    job = slow.fit({"train": data}, wait=False)
    deadline = time.monotonic() + 120
    while "epoch=3" not in job.log_path.read_text():
        assert time.monotonic() < deadline, job.log_path.read_text()[-3000:]
        time.sleep(0.5)
    job.stop()
    job.wait(logs=False)
    assert job.status == "Stopped"
    slurm_id = job.describe()["backend_info"]["slurm_job_id"]
    assert slurm.job_state(slurm_id) == "CANCELLED"
    deadline = time.monotonic() + 60  # slurmstepd ends the steps' processes
    while slurm.job_pids() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = {pid: cmdline(pid) for pid in slurm.job_pids()}
    assert not left, left

