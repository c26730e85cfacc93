"""Training jobs on the local backend: the job contract, artifacts, failures, resume,
stop and concurrent jobs, through the Estimator and the CLI."""

import json
import os
import tarfile
import threading
import time
from pathlib import Path

import fsspec
import pytest

from modelparallel.jobs import JobFailed, TrainingInput

LOSS = [{"Name": "train:loss", "Regex": r"train_loss=([0-9.]+)"}]


def data_dir(root: Path, n: int) -> Path:
    root.mkdir(parents=True)
    for i in range(n):
        sub = root / f"part{i % 2}"
        sub.mkdir(exist_ok=True)
        (sub / f"f{i:02d}.txt").write_text(str(i))
    return root


def records(output_tar: str, tmp: Path) -> dict[int, dict]:
    with tarfile.open(output_tar) as tar:
        tar.extractall(tmp, filter="data")
    return {json.loads(p.read_text())["rank"]: json.loads(p.read_text())
            for p in tmp.glob("rank*.json")}


@pytest.mark.timeout(240)
def test_contract_channels_artifacts_and_metrics(jobs, tmp_path):
    train = data_dir(tmp_path / "train", 7)
    val = data_dir(tmp_path / "val", 3)
    with fsspec.open("memory://contract-test/extra/a.txt", "w") as f:
        f.write("in memory")
    est = jobs.estimator("contract.py", instance_count=2, processes_per_host=2,
                         hyperparameters={"name": "first", "epochs": 2},
                         metric_definitions=LOSS)
    job = est.fit({"train": TrainingInput(str(train), distribution="ShardedByKey"),
                   "val": TrainingInput(f"file://{val}", input_mode="FastFile"),
                   "extra": "memory://contract-test/extra"}, logs=False)
    record = job.describe()
    assert record["status"] == "Completed", record
    assert [t["status"] for t in record["transitions"]] == \
        ["Pending", "Starting", "Training", "Completed"]
    assert record["exit_codes"] == {"algo-1": 0, "algo-2": 0}
    assert est.model_data == str(jobs.dir / job.name / "output" / "model.tar.gz")

    with tarfile.open(est.model_data) as tar:
        assert sorted(tar.getnames()) == ["sub", "sub/extra.txt", "weights.txt"]
        assert tar.extractfile("weights.txt").read() == b"model first"
    # only algo-1 packs output.tar.gz: ranks 0 and 1 wrote theirs there
    ranks = records(record["output_uri"], tmp_path / "out")
    assert sorted(ranks) == [0, 1]
    for _rank, r in ranks.items():
        env = r["env"]
        assert r["argv"] == ["--epochs", "2", "--name", "first"]  # sorted by key
        assert env["SM_CURRENT_HOST"] == env["MP_CURRENT_HOST"] == "algo-1"
        assert r["group_rank"] == "0"
        assert json.loads(env["SM_HOSTS"]) == json.loads(env["MP_HOSTS"]) == \
            ["algo-1", "algo-2"]
        assert json.loads(env["SM_HPS"]) == {"epochs": 2, "name": "first"}
        assert env["SM_HP_EPOCHS"] == "2"
        assert env["MP_NUM_PROCESSES"] == "4"
        for key in ("MODEL_DIR", "OUTPUT_DATA_DIR", "OUTPUT_DIR"):
            assert env[f"SM_{key}"] == env[f"MP_{key}"]
        assert env["MP_CHECKPOINT_DIR"] == str(jobs.dir / job.name / "checkpoints")
        run_dir = jobs.dir / job.name / "instances" / "algo-1" / "run"
        assert env["MP_RUN_DIR"] == str(run_dir)
        assert env["MP_METRICS_FILE"] == str(run_dir / "metrics.jsonl")
        assert r["cwd"].endswith("instances/algo-1/code")
        channels = r["channels"]
        assert channels["val"]["path"] == str(val)  # FastFile: read in place
        assert len(channels["val"]["files"]) == 3
        assert channels["extra"]["files"] == ["a.txt"]  # memory:// staged at submit
        assert env["SM_CHANNEL_TRAIN"] == channels["train"]["path"]
    algo1 = set(ranks[0]["channels"]["train"]["files"])
    # algo-2's view of the train channel, from its own directory
    algo2_dir = jobs.dir / job.name / "instances" / "algo-2" / "input" / "data" / "train"
    algo2 = {str(p.relative_to(algo2_dir)) for p in algo2_dir.rglob("*") if p.is_file()}
    everything = {str(p.relative_to(train)) for p in train.rglob("*") if p.is_file()}
    assert algo1.isdisjoint(algo2) and algo1 | algo2 == everything
    assert len(algo1) == 4 and len(algo2) == 3

    metrics = job.metrics
    assert metrics["train:loss"] == [1.0, 0.5]
    log = job.log_path.read_text()
    assert "[algo-1] [rank0]: epoch=1 train_loss=0.5000" in log

    described = jobs.cli("describe", job.name)
    assert described.returncode == 0, described.stderr
    assert "train:loss: 0.5" in described.stdout and "Completed" in described.stdout
    listed = jobs.cli("list", "--json")
    assert [j["name"] for j in json.loads(listed.stdout)] == [job.name]
    run_dir = jobs.dir / job.name / "instances" / "algo-1" / "run"
    assert json.loads(listed.stdout)[0]["run_dir"] == str(run_dir)
    assert json.loads((run_dir / "outcome.json").read_text())["exit_code"] == 0
    assert (run_dir / "report.html").is_file() and (run_dir / "config.json").is_file()
    assert oct(os.stat(jobs.dir / job.name).st_mode & 0o777) == "0o700"
    logs = jobs.cli("logs", job.name)
    assert "epoch=1 train_loss=0.5000" in logs.stdout


@pytest.mark.extended  # a failed job's report: test_cli_submit_exit_codes_and_errors
@pytest.mark.timeout(300)
def test_failures_and_concurrent_jobs(jobs, tmp_path):
    """Three jobs at once: one completes, one raises, one writes a failure file."""
    data = data_dir(tmp_path / "d", 2)
    started = []
    for name, fail in (("ok", ""), ("raises", "traceback"), ("file", "file")):
        est = jobs.estimator("contract.py", instance_count=2, job_name=name,
                             hyperparameters={"epochs": 3, "fail": fail},
                             metric_definitions=LOSS)
        started.append(est.fit({"train": str(data)}, wait=False))
    for job in started:
        job.wait(logs=False)
    ok, raises, file = (j.describe() for j in started)
    assert ok["status"] == "Completed" and ok["model_uri"]
    assert raises["status"] == "Failed" and raises["model_uri"] is None
    # algo-1 may have finished its part and packed a model; a failed job keeps none
    assert not (jobs.dir / "raises" / "output" / "model.tar.gz").exists()
    assert raises["exit_codes"]["algo-2"] == 1
    assert raises["failure_reason"].startswith("algo-2 exited with 1: ")
    assert "ValueError: injected failure in the training loop" in raises["failure_reason"]
    assert file["status"] == "Failed"
    assert file["failure_reason"] == \
        "algo-2 exited with 3: CustomError: the data was bad\nsecond line"
    for record in (ok, raises, file):  # every job's rows are its own
        metrics = jobs.store.metrics(record["name"])
        assert [m["value"] for m in metrics] == [1.0, 0.5, 0.3333], record["name"]
        assert len(jobs.store.transitions(record["name"])) == 4

    with pytest.raises(JobFailed, match="injected failure"):
        jobs.estimator("contract.py", instance_count=2, job_name="raises-again",
                       hyperparameters={"epochs": 1, "fail": "traceback"}).fit(
            {"train": str(data)}, logs=False)


@pytest.mark.extended  # long: two attempts of one job
@pytest.mark.timeout(240)
def test_resume_by_name_restores_checkpoints(jobs, tmp_path):
    data = data_dir(tmp_path / "d", 2)
    uri = f"file://{tmp_path / 'remote-checkpoints'}"
    first = jobs.estimator("contract.py", instance_count=2, job_name="resumable",
                           checkpoint_uri=uri, metric_definitions=LOSS,
                           hyperparameters={"epochs": 2, "fail": "traceback"})
    with pytest.raises(JobFailed):
        first.fit({"train": str(data)}, logs=False)
    remote = fsspec.filesystem("file")
    assert sorted(Path(p).name for p in remote.ls(str(tmp_path / "remote-checkpoints"))) \
        == ["epoch-0", "epoch-1"]

    again = jobs.estimator("contract.py", instance_count=2, job_name="resumable",
                           checkpoint_uri=uri, metric_definitions=LOSS,
                           hyperparameters={"epochs": 4})
    job = again.fit({"train": str(data)}, logs=False)
    record = job.describe()
    assert record["status"] == "Completed" and record["attempt"] == 2
    log = job.log_path.read_text().split("===== attempt 2 =====")[1]
    assert "restored 2 checkpoint file(s)" in log
    assert "found checkpoints: ['epoch-0', 'epoch-1']" in log
    assert job.metrics["train:loss"] == [0.3333, 0.25]  # epochs 2 and 3 only
    assert sorted(Path(p).name for p in remote.ls(str(tmp_path / "remote-checkpoints"))) \
        == ["epoch-0", "epoch-1", "epoch-2", "epoch-3"]
    attempts = [(t["attempt"], t["status"]) for t in record["transitions"]]
    assert attempts[0] == (1, "Pending") and attempts[3] == (1, "Failed")
    assert attempts[4:] == [(2, "Pending"), (2, "Starting"), (2, "Training"),
                            (2, "Completed")]


@pytest.mark.extended  # long: waits for jobs to run, then stops them
@pytest.mark.timeout(240)
def test_stop_and_max_run(jobs, tmp_path):
    data = data_dir(tmp_path / "d", 2)
    slow = {"epochs": 1000, "sleep": 0.2}
    job = jobs.estimator("contract.py", instance_count=2, job_name="slow",
                         hyperparameters=slow).fit({"train": str(data)}, wait=False)
    limited = jobs.estimator("contract.py", instance_count=1, job_name="limited", max_run=8,
                             hyperparameters=slow).fit({"train": str(data)}, wait=False)
    deadline = time.monotonic() + 60
    while "epoch=3" not in job.log_path.read_text():
        assert time.monotonic() < deadline, job.log_path.read_text()
        time.sleep(0.5)
    stopped = jobs.cli("stop", job.name, "--wait")
    assert stopped.returncode == 0, stopped.stderr
    record = job.describe()
    assert record["status"] == "Stopped"
    assert [t["status"] for t in record["transitions"]][-2:] == ["Stopping", "Stopped"]
    again = jobs.cli("stop", job.name)
    assert again.returncode == 0 and "already ended: Stopped" in again.stderr

    limited.wait(logs=False)
    record = limited.describe()
    assert record["status"] == "Stopped" and record["secondary_status"] == \
        "MaxRuntimeExceeded"
    assert "max_run=8s" in record["failure_reason"]


@pytest.mark.timeout(180)
def test_cli_submit_exit_codes_and_errors(jobs, tmp_path):
    data_dir(tmp_path / "d", 2)
    job_file = tmp_path / "job.yaml"
    scripts = Path(__file__).parent / "job_scripts"
    job_file.write_text(f"""
entry_point: contract.py
source_dir: {scripts}
instance_count: 2
processes_per_host: 1
hyperparameters: {{epochs: 1, fail: traceback}}
inputs:
  train: {{uri: d, distribution: ShardedByKey}}
""")
    failed = jobs.cli("submit", job_file, "--name", "from-yaml", "--quiet")
    assert failed.returncode == 1, failed.stderr
    assert "job from-yaml: Failed" in failed.stderr
    assert "injected failure" in failed.stderr

    missing = jobs.cli("describe", "no-such-job")
    assert missing.returncode == 4 and "no training job named 'no-such-job'" in \
        missing.stderr

    bad = tmp_path / "bad.yaml"
    bad.write_text(f"entry_point: nope.py\nsource_dir: {scripts}\ninstance_count: 2\n"
                   "processes_per_host: 1\ninputs: {train: missing-dir}\n"
                   "distribution: {modelparallel: {tensor_parallel_degree: 3}}\n")
    rejected = jobs.cli("submit", bad)
    assert rejected.returncode == 2
    for field in ("entry_point", "inputs.train", "distribution.modelparallel."
                  "tensor_parallel_degree"):
        assert f"- {field}:" in rejected.stderr, rejected.stderr
    assert jobs.store.get("bad") is None and len(jobs.store.list()) == 1


def test_store_survives_concurrent_writers(tmp_path):
    """Eight processes writing transitions and metrics at once lose nothing."""
    import multiprocessing

    from modelparallel.jobs.store import JobStore

    db = tmp_path / "jobs.db"
    store = JobStore(db)
    spec = {"instance_count": 1, "processes_per_host": 1, "hyperparameters": {}}
    for i in range(8):
        store.begin(f"job{i}", spec=spec, job_dir=str(tmp_path), backend="local",
                    checkpoint_uri=None)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_hammer, args=(str(db), f"job{i}")) for i in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    for i in range(8):
        assert len(store.metrics(f"job{i}")) == 200
        assert [t["status"] for t in store.transitions(f"job{i}")] == \
            ["Pending", "Starting", "Training", "Completed"]


def _hammer(db: str, name: str) -> None:
    from modelparallel.jobs.store import JobStore

    store = JobStore(db)
    store.transition(name, "Starting")
    store.transition(name, "Training")
    for step in range(100):
        store.add_metrics(name, 1, [("loss", 1.0 / (step + 1), step, time.time()),
                                    ("acc", step / 100, step, time.time())])
    store.transition(name, "Completed")
    threading.Event().wait(0.01)
