"""The seed's workflow as a job: the ViT example on digits PNGs from train/val channels,
2 instances x 2 processes, hybrid sharding + tensor parallel, on the local backend."""

import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "jobs"
sys.path.insert(0, str(EXAMPLE))
from run_jobs import digits_channels, score, vit_estimator  # noqa: E402


@pytest.fixture(scope="session")
def digits(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("digits")
    digits_channels(root)
    return root


def check_vit_job(est, digits: Path) -> None:
    """A completed ViT job: learned, recorded its metrics, and its model.tar.gz loads in
    one plain process and scores what the job logged."""
    job = est.latest_job
    record = job.describe()
    assert record["status"] == "Completed", record["failure_reason"]
    accuracy = job.metrics["val:accuracy"]
    assert len(accuracy) == 2 and accuracy[-1] > 0.5, accuracy
    assert len(job.metrics["step/loss"]) == 88  # the library's per-step records
    result = score(est.model_data, digits / "val")
    assert result["images"] == 359
    assert result["accuracy"] == pytest.approx(accuracy[-1], abs=1e-4)


@pytest.mark.extended  # the ViT job on Ray and SLURM nodes stays in the default tier
@pytest.mark.timeout(300)
def test_vit_job_hybrid_tensor_parallel(jobs, digits):
    est = vit_estimator("hybrid-tp", epochs=2, jobs_dir=jobs.dir)
    est.fit(digits_channels(digits), logs=False)
    check_vit_job(est, digits)
    log = est.latest_job.log_path.read_text()
    assert "dp_shard=2" in log and "tp=2" in log, log[-3000:]
