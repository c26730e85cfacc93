"""The ``modelparallel`` command line as a user types it: torchrun's spellings, bad values
refused on one line with exit code 2, ``--version``, and who a run directory belongs to."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from modelparallel.launch.cli import _parser, endpoint, main
from modelparallel.launch.run import RunOptions, torchrun_argv
from modelparallel.launch.run_owner import RunDirectoryError, claim
from modelparallel.version import __version__


def command(capsys, *argv: str) -> tuple[int, list[str]]:
    """Exit code and stderr lines of ``modelparallel ARGV`` (in this process)."""
    with pytest.raises(SystemExit) as done:
        main(list(argv))
    captured = capsys.readouterr()
    return done.value.code, (captured.err or captured.out).splitlines()


@pytest.mark.parametrize("argv, says", [
    (["--nproc-per-node", "0"], "--nproc-per-node/--nproc_per_node: must be a whole number "
                                "of at least 1, got '0'"),
    (["--nproc_per_node", "-1"], "must be a whole number of at least 1, got '-1'"),
    (["--nproc_per_node", "two"], "must be a whole number of at least 1, got 'two'"),
    (["--nnodes", "0"], "--nnodes: must be a whole number of at least 1"),
    (["--max_restarts", "-2"], "--max-restarts/--max_restarts: must be a whole number of "
                               "at least 0, got '-2'"),
    (["--nnodes", "2", "--node_rank", "2"], "--node-rank 2 is not below --nnodes 2"),
    (["--master_port", "70000"], "must be a port number (1 to 65535), got '70000'"),
    (["--ranks-filter", "0,x"], "must be local ranks separated by commas"),
    (["--standalone", "--nnodes", "2"], "--standalone is one node; --nnodes is 2"),
])
def test_a_bad_value_is_one_line_and_exit_code_2(capsys, argv, says):
    code, lines = command(capsys, "run", *argv, "train.py")
    assert code == 2
    assert len(lines) == 1, lines
    assert lines[0].startswith("modelparallel run: error: ") and says in lines[0], lines
    assert lines[0].endswith("(see `modelparallel run --help`)")


def test_torchruns_underscore_spellings_are_accepted():
    args = _parser().parse_args([
        "run", "--nproc_per_node=2", "--nnodes", "2", "--node_rank", "1",
        "--master_addr", "10.0.0.1", "--master_port", "29400", "--max_restarts", "3",
        "--rdzv_id", "job7", "--log_dir", "/tmp/logs", "--run_dir", "/tmp/run",
        "--local_ranks_filter", "0", "train.py", "--lr", "1"])
    assert (args.nproc_per_node, args.nnodes, args.node_rank, args.max_restarts) == (2, 2, 1, 3)
    assert endpoint(args) == "10.0.0.1:29400"
    assert (args.rdzv_id, args.log_dir, args.run_dir) == ("job7", "/tmp/logs", "/tmp/run")
    assert args.script == "train.py" and args.script_args == ["--lr", "1"]
    for spelling in ("--ranks-filter", "--local-ranks-filter", "--local_ranks_filter"):
        assert _parser().parse_args(["run", spelling, "0, 3", "t.py"]).ranks_filter == "0,3"


def test_the_ranks_filter_reaches_torchrun():
    argv = torchrun_argv(RunOptions(script="t.py", ranks_filter="0,3"), 4)
    assert "--local-ranks-filter=0,3" in argv


def test_version(capsys):
    code, lines = command(capsys, "--version")
    assert code == 0 and lines == [f"modelparallel {__version__}"]


def launch(script: str = "train.py", *args: str, nnodes: int = 1) -> SimpleNamespace:
    return SimpleNamespace(script=script, script_args=list(args), nnodes=nnodes,
                           rdzv_endpoint="h:1" if nnodes > 1 else None, rdzv_id="r")


@pytest.fixture
def no_job(monkeypatch):
    for name in ("MP_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_run_directory_refuses_another_run(tmp_path, no_job):
    run_dir = tmp_path / "out"
    assert claim(run_dir, launch(), "first") == ("first", False)
    with pytest.raises(RunDirectoryError) as refused:
        claim(run_dir, launch("eval.py"), "second")
    message = str(refused.value)
    assert "\n" not in message
    assert f"{run_dir} holds another run (first, started " in message
    assert "as `train.py`" in message and "give this run a --run-dir of its own" in message
    assert "set MP_RUN_ID=first" in message
    assert json.loads((run_dir / "owner.json").read_text())["run_id"] == "first"


def test_the_same_run_continues_in_its_directory(tmp_path, no_job):
    run_dir = tmp_path / "out"
    claim(run_dir, launch(), "first")
    no_job.setenv("MP_RUN_ID", "first")  # a restarted or requeued job names its run
    assert claim(run_dir, launch(), "second") == ("first", True)
    no_job.setenv("MP_RUN_ID", "other")
    with pytest.raises(RunDirectoryError):
        claim(run_dir, launch(), "second")


def test_a_requeued_slurm_job_and_its_nodes_share_the_directory(tmp_path, no_job):
    run_dir = tmp_path / "out"
    no_job.setenv("SLURM_JOB_ID", "4711")
    assert claim(run_dir, launch("train.py", "--lr", "1"), "node0") == ("node0", False)
    assert claim(run_dir, launch("train.py", "--lr", "1"), "node1") == ("node0", True)
    with pytest.raises(RunDirectoryError):  # another command in the same job
        claim(run_dir, launch("eval.py"), "eval")
    no_job.setenv("SLURM_JOB_ID", "4712")
    with pytest.raises(RunDirectoryError):  # another job
        claim(run_dir, launch("train.py", "--lr", "1"), "later")


def test_a_directory_from_before_owner_records_is_another_run(tmp_path, no_job):
    (tmp_path / "config.json").write_text(json.dumps(
        {"run_id": "old", "launch": {"script": "/x/train.py", "script_args": []}}))
    with pytest.raises(RunDirectoryError, match=r"holds another run \(old, .*set MP_RUN_ID=old"):
        claim(tmp_path, launch(), "new")
