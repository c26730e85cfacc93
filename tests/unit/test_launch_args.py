"""How `modelparallel run` options become a torchrun command line."""

import signal

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from modelparallel.launch.run import RunOptions, failure_summary, first_failure, torchrun_argv


def test_single_node_binds_to_loopback_and_tees_output():
    argv = torchrun_argv(RunOptions(script="train.py", script_args=["--lr", "1"]), nproc=4)
    assert "--nproc-per-node=4" in argv and "--nnodes=1" in argv and "--tee=3" in argv
    assert "--rdzv-endpoint=127.0.0.1:0" in argv and "--local-addr=127.0.0.1" in argv
    assert argv[-3:] == ["train.py", "--lr", "1"]


def test_fixed_node_rank_uses_a_static_rendezvous_at_the_endpoint():
    argv = torchrun_argv(RunOptions(script="t.py", nnodes=2, node_rank=1,
                                    rdzv_endpoint="10.0.0.1:29400"), nproc=8)
    assert {"--rdzv-backend=static", "--master-addr=10.0.0.1", "--master-port=29400",
            "--node-rank=1", "--nnodes=2"} <= set(argv)
    assert not any(a.startswith("--local-addr") for a in argv)


def test_without_node_rank_nodes_join_a_c10d_rendezvous():
    argv = torchrun_argv(RunOptions(script="t.py", nnodes=2, rdzv_endpoint="h:1",
                                    rdzv_id="job7", max_restarts=3), nproc=2)
    assert {"--rdzv-backend=c10d", "--rdzv-endpoint=h:1", "--rdzv-id=job7",
            "--max-restarts=3"} <= set(argv)


def test_several_nodes_need_an_endpoint(tmp_path, capsys):
    from modelparallel.launch.run import run

    script = tmp_path / "t.py"
    script.write_text("pass\n")
    assert run(RunOptions(script=str(script), nnodes=2)) == 2
    assert "--nnodes 2 needs --rdzv-endpoint HOST:PORT" in capsys.readouterr().err


def test_a_rank_the_launcher_stopped_is_never_the_first_failure(tmp_path):
    """torchrun's timestamps are whole seconds; a tie must not blame a SIGTERMed rank."""
    def failure(rank: int, exitcode: int) -> ProcessFailure:
        f = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode,
                           error_file=str(tmp_path / "none"))
        f.timestamp = 1000
        return f

    error = ChildFailedError("train.py", {0: failure(0, -signal.SIGTERM), 1: failure(1, 1),
                                          2: failure(2, -signal.SIGKILL)})
    assert first_failure(error)[0] == 1
    summary = failure_summary(error)
    assert "rank 1 (local rank 1) failed first with exit code 1" in summary
    assert "also failed: rank(s) 2" in summary
    assert "stopped by the launcher: rank(s) 0" in summary
    only_stopped = ChildFailedError("train.py", {3: failure(3, -signal.SIGTERM)})
    assert first_failure(only_stopped)[0] == 3
