"""The job store is its user's alone (database 0600, directories 0700), and every job's
run directory is where its metrics go and what ``modelparallel jobs list`` shows."""

from __future__ import annotations

import json
import os
import stat

import pytest

from modelparallel.jobs.instance import worker_environment
from modelparallel.jobs.layout import JobLayout
from modelparallel.jobs.spec import build_spec
from modelparallel.jobs.store import JobStore
from modelparallel.launch.cli import main as cli_main


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def permissive_umask():
    old = os.umask(0o022)  # what most shells have: files 0644, directories 0755
    yield
    os.umask(old)


def spec_for(tmp_path, name="job"):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    return build_spec(entry_point=str(script), source_dir=None, instance_count=2,
                      processes_per_host=1, hyperparameters={}, distribution=None,
                      inputs=None, output_path=str(tmp_path / "out"), checkpoint_uri=None,
                      environment=None, max_run=None, max_restarts=0,
                      metric_definitions=None, backend="local", backend_options={}, name=name)


def test_a_new_store_is_private(tmp_path, permissive_umask):
    store = JobStore(tmp_path / "jobs" / "jobs.db")
    store.begin("a", spec=json.loads(spec_for(tmp_path).to_json()), job_dir="/x",
                backend="local", checkpoint_uri=None)
    assert mode(tmp_path / "jobs") == 0o700
    written = [p for p in (tmp_path / "jobs").iterdir() if p.name.startswith("jobs.db")]
    assert tmp_path / "jobs" / "jobs.db" in written
    assert {p.name: mode(p) for p in written} == {p.name: 0o600 for p in written}


def test_an_existing_store_is_made_private(tmp_path, permissive_umask):
    (tmp_path / "jobs.db").touch(mode=0o644)
    assert mode(tmp_path / "jobs.db") == 0o644
    JobStore(tmp_path / "jobs.db")
    assert mode(tmp_path / "jobs.db") == 0o600


def test_job_directories_are_private(tmp_path, permissive_umask):
    (tmp_path / "old").mkdir(mode=0o755)
    for name in ("new", "old"):
        JobLayout(tmp_path / name).create()
        assert mode(tmp_path / name) == 0o700


def test_the_metrics_file_is_in_the_run_directory(tmp_path):
    layout = JobLayout(tmp_path / "job")
    env = worker_environment(spec_for(tmp_path), 1, {}, layout, tmp_path)
    assert env["MP_METRICS_FILE"] == str(tmp_path / "job/instances/algo-2/run/metrics.jsonl")
    assert layout.run_dir(1) == tmp_path / "job/instances/algo-2/run"


def test_jobs_list_shows_each_run_directory(tmp_path, capsys):
    store = JobStore(tmp_path / "jobs.db")
    for name in ("first", "second"):
        store.begin(name, spec=json.loads(spec_for(tmp_path, name).to_json()),
                    job_dir=str(tmp_path / name), backend="local", checkpoint_uri=None)
        store.transition(name, "Completed")
    for extra in ([], ["--json"]):
        with pytest.raises(SystemExit) as exit_:
            cli_main(["jobs", "--jobs-dir", str(tmp_path), "list", *extra])
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        if extra:
            listed = {j["name"]: j["run_dir"] for j in json.loads(out)}
        else:
            header, *rows = out.splitlines()
            assert header.split()[-2:] == ["RUN", "DIR"]
            listed = {row.split()[0]: row.split()[-1] for row in rows}
        assert listed == {n: str(tmp_path / n / "instances/algo-1/run")
                          for n in ("first", "second")}
