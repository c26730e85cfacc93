"""The ray backend on a real two-node Ray cluster (127.0.0.2 and 127.0.0.3) started by
the test: the ViT job with one instance per node, and a job whose node is lost."""

from __future__ import annotations

import time

import pytest
from ray_cluster import WORKER_IP, ray_cluster_fixture, skip_reason  # noqa: F401
from test_jobs_local import data_dir
from test_jobs_vit import check_vit_job, digits  # noqa: F401

if skip_reason():
    pytest.skip(skip_reason(), allow_module_level=True)

from run_jobs import digits_channels, vit_estimator


@pytest.mark.extended  # starts a Ray instance of its own
@pytest.mark.timeout(300)
def test_without_address_a_local_ray_is_started(jobs, tmp_path, monkeypatch):
    """No cluster given: the runner starts a one-node Ray for the job; both instances land
    on it and take loopback addresses, as on the local backend."""
    # Ray writes ~/.ray/auth_token when it starts a local cluster, and `ray start` then
    # turns on token authentication: keep that away from the other tests' clusters
    monkeypatch.setenv("HOME", str(tmp_path))
    job = jobs.estimator("contract.py", instance_count=2, backend="ray", job_name="solo",
                         hyperparameters={"epochs": 2}).fit(
        {"train": str(data_dir(tmp_path / "d", 3))}, logs=False)
    record = job.describe()
    assert record["status"] == "Completed"
    assert record["backend_info"]["ray_strategy"] == "PACK"
    assert record["backend_info"]["addresses"] == ["127.0.1.100", "127.0.1.101"]
    assert (tmp_path / ".ray" / "auth_token").is_file()  # what the HOME above is for


@pytest.mark.timeout(400)
def test_vit_job_on_two_ray_nodes(jobs, ray_cluster, digits):  # noqa: F811
    est = vit_estimator("hybrid-tp", epochs=2, backend="ray", jobs_dir=jobs.dir,
                        backend_options={"address": ray_cluster.address})
    est.fit(digits_channels(digits), logs=False)
    check_vit_job(est, digits)
    record = est.latest_job.describe()
    # one instance per node, numbered in address order
    assert record["backend_info"]["ray_strategy"] == "STRICT_SPREAD"
    assert record["backend_info"]["addresses"] == ["127.0.0.2", "127.0.0.3"]
    log = est.latest_job.log_path.read_text()
    assert "rendezvous 127.0.0.2:" in log


@pytest.mark.extended  # long fault test
@pytest.mark.timeout(300)
def test_lost_node_fails_the_job(jobs, ray_cluster, tmp_path):
    """Runs last: it takes the worker node down."""
    job = jobs.estimator("contract.py", instance_count=2, backend="ray", job_name="lost",
                         hyperparameters={"epochs": 1000, "sleep": 0.2},
                         backend_options={"address": ray_cluster.address}).fit(
        {"train": str(data_dir(tmp_path / "d", 2))}, wait=False)
    deadline = time.monotonic() + 120
    while "epoch=3" not in job.log_path.read_text():
        assert time.monotonic() < deadline, job.log_path.read_text()[-3000:]
        assert job.status == "InProgress", job.describe()["failure_reason"]
        time.sleep(0.5)
    ray_cluster.kill_node(WORKER_IP)
    lost_at = time.monotonic()
    job.wait(logs=False)
    record = job.describe()
    assert record["status"] == "Failed"
    assert record["failure_reason"].startswith("algo-2 exited with "), record["failure_reason"]
    assert ": instance algo-2 lost its Ray node: " in record["failure_reason"]
    assert time.monotonic() - lost_at < 90
