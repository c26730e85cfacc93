"""Never hang: a rank that stops answering ends the whole run within collective_timeout.

Each run is bounded twice, by pytest's timeout and by the subprocess timeout of the
``modelparallel`` fixture, so a regression fails the test instead of hanging CI. The
last tests check the pure logic behind the messages (no processes).
"""

import json
import re
import signal
import time

import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from modelparallel.launch.run import failure_summary, first_failure
from modelparallel.launch.worker import is_collective_timeout, timeout_hint

# What gloo (torch 2.13) raised in these runs
GLOO_RECV_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
                     "unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to "
                     "complete")
GLOO_SEND_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
                     "unbound_buffer.cc:129] Timed out waiting 4000ms for send operation to "
                     "complete")
GLOO_PEER_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
                    "Connection closed by peer [127.0.0.1]:49856. This is typically caused by "
                    "a remote worker crashing. Check the logs of the remote worker before "
                    "reporting an error.")


def summary_of(ran) -> str:
    return ran.err[ran.err.index("modelparallel run: rank"):]


@pytest.mark.timeout(180)
def test_a_killed_rank_ends_the_run_and_is_named(modelparallel, script):
    path = script("""
        import os, signal, time
        import torch
        import torch.distributed as dist
        import modelparallel as mp
        mp.init({"collective_timeout": 5})
        for step in range(1000):
            if step == 3 and mp.rank() == 1:
                print("killed at", time.time(), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(torch.ones(1000))
    """)
    ran = modelparallel("run", "--nproc-per-node", 2, path, timeout=150)
    ended = time.time()
    assert ran.code == 128 + signal.SIGKILL, ran.all
    waited = ended - float(re.search(r"\[rank1\]: killed at ([\d.]+)", ran.out).group(1))
    assert waited < 60, f"the run ended {waited:.0f}s after rank 1 was killed"
    summary = summary_of(ran)
    assert "rank 1 (local rank 1) failed first with signal SIGKILL" in summary, summary
    print(f"ended {waited:.1f}s after the kill, {ran.seconds:.1f}s after launch")


@pytest.mark.timeout(180)
def test_collective_timeout_reaches_every_process_group(modelparallel, script):
    """The default group and the mesh groups all get the configured timeout.

    With 2 ranks DeviceMesh reuses the default group for the 2-rank dims; the 1-rank
    dims (pp, tp, dp_shard, and mp = pp x tp here) are groups of their own, which torch
    would create with its 30-minute gloo default.
    """
    path = script("""
        import torch
        import torch.distributed as dist
        import modelparallel as mp
        mp.init({"collective_timeout": 7.5, "hybrid_shard_degree": 1})
        def timeout(group):  # torch has no public getter; new_group reads the same field
            return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        groups = {"world": dist.group.WORLD}
        groups.update((name, mesh.get_group()) for name, mesh in mp.state.meshes.items())
        own = sorted(name for name, g in groups.items() if g is not dist.group.WORLD)
        print(mp.rank(), sorted((name, timeout(g)) for name, g in groups.items()), flush=True)
        print(mp.rank(), "own groups", own, flush=True)
    """)
    ran = modelparallel("run", "--nproc-per-node", 2, path, timeout=150)
    assert ran.code == 0, ran.all
    for rank in (0, 1):
        line = re.search(rf"\[rank{rank}\]: {rank} (\[.*\])", ran.out)
        assert line, ran.out
        timeouts = dict(eval(line.group(1)))
        assert {"world", "dp", "rdp", "mp", "tp", "pp", "dp_shard",
                "dp_replicate"} <= set(timeouts)
        assert set(timeouts.values()) == {7.5}, timeouts
        assert f"[rank{rank}]: {rank} own groups ['dp_shard', 'mp', 'pp', 'tp']" in ran.out


# -- the logic behind the messages (no processes) ---------------------------------------

@pytest.mark.parametrize("error", [
    RuntimeError(GLOO_RECV_TIMEOUT),
    RuntimeError(GLOO_SEND_TIMEOUT),
    dist.DistBackendError("[Rank 0] Watchdog caught collective operation timeout: "
                          "WorkNCCL(SeqNum=7, OpType=ALLREDUCE, Timeout(ms)=600000) ran "
                          "for 600042 milliseconds before timing out."),
    dist.DistBackendError("Work WorkNCCL(SeqNum=7, OpType=ALLREDUCE) timed out in blocking "
                          "wait"),
])
def test_collective_timeouts_are_recognised(error):
    assert is_collective_timeout(error)


def test_a_timeout_that_caused_another_error_is_recognised():
    try:
        try:
            raise RuntimeError(GLOO_RECV_TIMEOUT)
        except RuntimeError as e:
            raise ValueError("loss is not finite") from e
    except ValueError as wrapped:
        assert is_collective_timeout(wrapped)


@pytest.mark.parametrize("error", [
    RuntimeError(GLOO_PEER_CLOSED),  # another rank ended: the summary names it
    dist.DistStoreError("Timed out after 901 seconds waiting for clients. 1/2 clients "
                        "joined."),  # rendezvous, not a collective
    ValueError("bad batch"),
])
def test_other_errors_are_not_collective_timeouts(error):
    assert not is_collective_timeout(error)


def test_hint_names_the_setting_and_what_to_do():
    hint = timeout_hint()
    assert hint.startswith("hint: a collective waited longer than collective_timeout")
    assert "another rank failed, was killed, or did not call the same collective" in hint
    assert "raise collective_timeout in the config" in hint


def _failure(tmp_path, rank: int, exitcode: int, timestamp: int,
             error: str | None = None) -> ProcessFailure:
    path = tmp_path / f"error{rank}.json"
    if error is not None:  # what the worker wrapper writes
        path.write_text(json.dumps({"message": {"message": error, "extraInfo": {
            "py_callstack": error, "timestamp": str(timestamp)}}}))
    failure = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode,
                             error_file=str(path))
    failure.timestamp = timestamp
    return failure


@pytest.mark.parametrize("peer_error", [GLOO_PEER_CLOSED, GLOO_RECV_TIMEOUT])
def test_a_rank_that_only_saw_its_peer_go_is_not_the_first_failure(tmp_path, peer_error):
    """torchrun can see rank 0's "Connection closed by peer" exit before (or in the same
    second as) the SIGKILL of rank 1 that caused it."""
    error = ChildFailedError("train.py", {
        0: _failure(tmp_path, 0, 1, 1000, f"RuntimeError: {peer_error}"),
        1: _failure(tmp_path, 1, -signal.SIGKILL, 1001)})
    assert first_failure(error)[0] == 1
    summary = failure_summary(error)
    assert "rank 1 (local rank 1) failed first with signal SIGKILL" in summary
    assert "also failed: rank(s) 0" in summary


def test_a_timeout_is_the_first_failure_when_the_other_rank_was_stopped(tmp_path):
    error = ChildFailedError("train.py", {
        0: _failure(tmp_path, 0, 1, 1000, f"RuntimeError: {GLOO_RECV_TIMEOUT}"),
        1: _failure(tmp_path, 1, -signal.SIGTERM, 1000)})
    assert first_failure(error)[0] == 0
    summary = failure_summary(error)
    assert f"error: RuntimeError: {GLOO_RECV_TIMEOUT}" in summary
