"""Job descriptions are checked before anything starts; every problem names its field."""

import json

import fsspec
import pytest

from modelparallel.jobs import Estimator, JobError, TrainingInput
from modelparallel.jobs.channels import materialize, shard
from modelparallel.jobs.instance import hyperparameter_args
from modelparallel.jobs.spec import parse_distribution, read_job_file


@pytest.fixture
def code(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text("print('hi')\n")
    return src


def problems(code, inputs=None, **kwargs) -> dict[str, str]:
    kwargs.setdefault("source_dir", str(code))
    kwargs.setdefault("processes_per_host", 2)
    with pytest.raises(JobError) as e:
        Estimator(kwargs.pop("entry_point", "train.py"), **kwargs,
                  jobs_dir=code.parent / "jobs").prepare(inputs)
    return dict(e.value.problems)


def test_missing_entry_point(code, tmp_path):
    assert "does not exist" in problems(code, entry_point=str(tmp_path / "nope.py"),
                                        source_dir=None)["entry_point"]
    assert "is missing" in problems(code, entry_point="")["entry_point"]


def test_source_dir_without_the_entry_point(code, tmp_path):
    found = problems(code, entry_point="other.py")
    assert "'other.py' is not a file in source_dir" in found["entry_point"]
    assert "is not a directory" in problems(code, source_dir=str(tmp_path / "x"))[
        "source_dir"]


def test_unknown_distribution_keys(code):
    found = problems(code, distribution={"horovod": {}, "mpi": {"enabled": True, "np": 2},
                                         "smdistributed": {"modelparalel": {}}})
    assert "unknown distribution" in found["distribution.horovod"]
    assert "unknown key" in found["distribution.mpi.np"]
    assert "unknown key" in found["distribution.smdistributed.modelparalel"]
    found = problems(code, distribution={"modelparallel": {"tensor_paralel_degree": 2}})
    assert "did you mean 'tensor_parallel_degree'" in \
        found["distribution.modelparallel.tensor_paralel_degree"]


def test_channel_that_does_not_exist(code, tmp_path):
    found = problems(code, inputs={"train": str(tmp_path / "missing"),
                                   "val": f"file://{tmp_path}/gone",
                                   "test": "memory://nothing/here",
                                   "bad": TrainingInput(str(code), input_mode="Pipe")})
    assert "does not exist" in found["inputs.train"]
    assert "does not exist" in found["inputs.val"]
    assert "does not exist" in found["inputs.test"]
    assert "'Pipe' is not one of File, FastFile" in found["inputs.bad.input_mode"]


def test_degrees_must_match_instances_times_processes(code):
    found = problems(code, instance_count=2, processes_per_host=2,
                     distribution={"modelparallel": {"tensor_parallel_degree": 3}})
    message = found["distribution.modelparallel.tensor_parallel_degree"]
    assert "does not divide the world size 4" in message
    assert "instance_count=2 x processes_per_host=2 = 4 processes" in message
    found = problems(code, instance_count=1, processes_per_host=None, distribution={
        "smdistributed": {"modelparallel": {"enabled": True,
                                            "parameters": {"partitions": 4}}},
        "mpi": {"enabled": True, "processes_per_host": 6}})
    assert "pipeline_parallel_degree" in \
        "".join(found)  # SMP v1's "partitions" is our pipeline degree
    assert "6 processes" in next(iter(found.values()))


def test_other_fields(code):
    found = problems(code, instance_count=0, processes_per_host=-1, max_run=0,
                     max_restarts=-1, backend="mesos", output_path="memory://x",
                     metric_definitions=[{"Name": "loss", "Regex": "loss=[0-9.]+"}, {}],
                     job_name="bad_name!", hyperparameters={"bad key": 1})
    for field in ("instance_count", "processes_per_host", "max_run", "max_restarts",
                  "backend", "output_path", "metric_definitions[0].Regex",
                  "metric_definitions[1]", "job_name", "hyperparameters.bad key"):
        assert field in found, (field, found)
    found = problems(code, processes_per_host=2,
                     distribution={"mpi": {"enabled": True, "processes_per_host": 4}})
    assert "conflicts with processes_per_host=2" in found["distribution.mpi.processes_per_host"]


def test_distribution_forms():
    assert parse_distribution({"modelparallel": {"hybrid_shard_degree": 2}}) == \
        ({"hybrid_shard_degree": 2}, None)
    assert parse_distribution({"torch_distributed": {"enabled": True}}) == ({}, None)
    assert parse_distribution({"smdistributed": {"dataparallel": {"enabled": True}}}) == \
        ({}, None)
    assert parse_distribution({
        "smdistributed": {"modelparallel": {"enabled": True, "parameters": {
            "partitions": 2, "microbatches": 4, "ddp": True}}},
        "mpi": {"enabled": True, "processes_per_host": 8}}) == \
        ({"pipeline_parallel_degree": 2, "microbatches": 4, "ddp": True}, 8)


def test_a_valid_spec(code, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    spec = Estimator("train.py", source_dir=str(code), instance_count=2,
                     processes_per_host=2, hyperparameters={"b": 1, "a": "x"},
                     distribution={"modelparallel": {"tensor_parallel_degree": 2}},
                     jobs_dir=tmp_path / "jobs").prepare({"train": f"file://{data}"},
                                                         job_name="ok-1")
    assert spec.world_size == 4 and spec.hosts == ["algo-1", "algo-2"]
    assert spec.config == {"tensor_parallel_degree": 2}
    assert spec.inputs["train"].uri == str(data)
    assert spec.output_path == str(tmp_path / "jobs")
    assert type(spec).from_json(spec.to_json()) == spec


def test_hyperparameters_become_sorted_arguments():
    assert hyperparameter_args({"lr": 0.1, "epochs": 3, "name": "x y", "flag": True,
                                "layers": [1, 2]}) == \
        ["--epochs", "3", "--flag", "true", "--layers", "[1, 2]", "--lr", "0.1",
         "--name", "x y"]


def test_sharded_by_key_is_disjoint_and_complete(tmp_path):
    keys = [f"k{i}" for i in range(10)]
    parts = [shard(keys, i, 3, "ShardedByKey") for i in range(3)]
    assert sorted(k for part in parts for k in part) == keys
    assert parts[0] == ["k0", "k3", "k6", "k9"]
    assert shard(keys, 2, 3, "FullyReplicated") == keys
    with fsspec.open("memory://shards/a/1.txt", "w") as f:
        f.write("1")
    with fsspec.open("memory://shards/b/2.txt", "w") as f:
        f.write("2")
    one = materialize(TrainingInput("memory://shards", "ShardedByKey"), tmp_path / "i0", 0, 2)
    two = materialize(TrainingInput("memory://shards", "ShardedByKey"), tmp_path / "i1", 1, 2)
    assert (tmp_path / "i0" / "a" / "1.txt").read_text() == "1" and one == str(tmp_path / "i0")
    assert (tmp_path / "i1" / "b" / "2.txt").read_text() == "2" and two == str(tmp_path / "i1")
    assert not (tmp_path / "i0" / "b").exists()


def test_job_file_paths_are_relative_to_the_file(code, tmp_path):
    (tmp_path / "data").mkdir()
    job = tmp_path / "job.yaml"
    job.write_text("entry_point: train.py\nsource_dir: src\ninputs:\n  train: data\n"
                   "  val: {uri: data, input_mode: FastFile}\noutput_path: out\n")
    fields = read_job_file(job)
    assert fields["source_dir"] == str(code)
    assert fields["inputs"] == {"train": str(tmp_path / "data"),
                                "val": {"uri": str(tmp_path / "data"),
                                        "input_mode": "FastFile"}}
    assert fields["output_path"] == str(tmp_path / "out")
    job.write_text(json.dumps({"entry_point": "train.py", "instance_type": "ml.p4d"}))
    with pytest.raises(JobError, match="instance_type: unknown field"):
        read_job_file(job)
