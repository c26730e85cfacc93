"""`modelparallel run` and `check-config` as a shell user meets them."""

import re
import socket
import subprocess
import sys


def test_runs_every_rank_with_prefixed_output_and_arguments(modelparallel, script):
    path = script("""
        import os, sys
        import modelparallel as mp
        mp.init({"hybrid_shard_degree": 1})
        print("hello", mp.rank(), mp.size(), mp.dp_rank(), sys.argv[1:], flush=True)
        print("bound to", os.environ["MASTER_ADDR"], os.environ["GLOO_SOCKET_IFNAME"])
        mp.barrier()
    """)
    ran = modelparallel("run", "--nproc-per-node", 2, path, "--lr", "0.1", "--", "x")
    assert ran.code == 0, ran.all
    for rank in (0, 1):
        assert f"[rank{rank}]: hello {rank} 2 {rank} ['--lr', '0.1', '--', 'x']" in ran.out
        assert f"[rank{rank}]: bound to 127.0.0.1 lo" in ran.out


def test_failure_names_the_first_failing_rank_with_its_traceback(modelparallel, script):
    path = script("""
        import modelparallel as mp
        mp.init()
        if mp.rank() == 1:
            raise ValueError("bad batch on rank 1")
        mp.barrier()
    """)
    ran = modelparallel("run", "--nproc-per-node", 2, path)
    assert ran.code == 1
    summary = ran.err[ran.err.index("modelparallel run: rank"):]
    assert "rank 1 (local rank 1) failed first with exit code 1" in summary
    assert "error: ValueError: bad batch on rank 1" in summary
    assert f'in your code: {path}:5: raise ValueError("bad batch on rank 1")' in summary
    assert "modelparallel/launch/worker.py" not in summary, "wrapper frames are hidden"
    assert ran.all.count("bad batch on rank 1") == 2, "the summary's two lines, nothing else"


def test_exit_code_of_the_script_is_the_exit_code_of_the_run(modelparallel, script):
    path = script("""
        import sys
        import modelparallel as mp
        mp.init()
        sys.exit(3 if mp.rank() == 0 else 0)
    """)
    ran = modelparallel("run", "--nproc-per-node", 2, path)
    assert ran.code == 3
    assert "rank 0 (local rank 0) failed first with exit code 3" in ran.err


def test_config_error_ends_all_ranks_with_the_message(modelparallel, script):
    path = script("""
        import modelparallel as mp
        mp.init({"tensor_parallel_degree": 3})
        mp.barrier()  # never reached: validation runs before any collective
    """)
    ran = modelparallel("run", "--nproc-per-node", 4, path, timeout=120)
    assert ran.code == 1, ran.all
    summary = ran.err[ran.err.index("modelparallel run: rank"):]
    assert re.search(r"rank \d \(local rank \d\) failed first with exit code 1", summary)
    assert "ConfigError: invalid modelparallel configuration" in summary
    assert "tensor_parallel_degree=3 = 3 does not divide the world size 4" in summary
    # The error is printed once. A rank still starting up when another failed is stopped
    # by the launcher; every other rank reached the check on its own (test below) and is
    # named: first, or as failing with the same error.
    assert ran.all.count("ConfigError: invalid modelparallel configuration") == 1, ran.all
    named = set()
    for pattern in (r"stopped by the launcher: rank\(s\) ([\d, ]+)",
                    r"the same error on rank\(s\) ([\d, ]+)", r"rank (\d) \(local rank"):
        if found := re.search(pattern, summary):
            named |= {int(r) for r in found.group(1).split(",")}
    assert named == set(range(4)), summary
    print(f"4 ranks ended {ran.seconds:.1f}s after launch")


def test_config_error_needs_no_other_rank(script, clean_env):
    """Rank 3 of 4 started alone fails at once: validation waits for no peer."""
    path = script("""
        import modelparallel as mp
        mp.init({"tensor_parallel_degree": 3})
    """)
    env = {**clean_env, "RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "4",
           "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          env=env, timeout=60)  # a rendezvous would wait 10 minutes for peers
    assert proc.returncode == 1
    assert "tensor_parallel_degree=3 = 3 does not divide the world size 4" in proc.stderr


def test_launcher_config_overrides_the_script_and_is_logged_once(modelparallel, script,
                                                                  tmp_path):
    config = tmp_path / "mp.yaml"
    config.write_text("microbatches: 2\nhybrid_shard_degree: 1\n")
    path = script("""
        import modelparallel as mp
        mp.init({"microbatches": 1})
        print("microbatches", mp.state.config.microbatches, flush=True)
    """)
    ran = modelparallel("run", "--nproc-per-node", 2, "--config", config, path)
    assert ran.code == 0, ran.all
    assert ran.out.count("microbatches 2") == 2
    assert ran.err.count("MP_CONFIG from the launcher overrides") == 1
    assert "microbatches: 1 -> 2" in ran.err


def test_bad_launcher_config_is_rejected_before_anything_starts(modelparallel, script,
                                                                 tmp_path):
    config = tmp_path / "mp.json"
    config.write_text('{"hybrid_shard_degree": 3}')
    ran = modelparallel("run", "--nproc-per-node", 4, "--config", config, script("pass\n"))
    assert ran.code == 2
    assert "hybrid_shard_degree: 3 does not divide the data-parallel size 4" in ran.err
    assert "[rank" not in ran.all, "no worker was started"


def test_missing_script(modelparallel, tmp_path):
    ran = modelparallel("run", tmp_path / "nope.py")
    assert ran.code == 2 and "does not exist" in ran.err


def test_two_nodes_meet_at_a_rendezvous_endpoint(script, clean_env):
    """Two launchers, as on two hosts (here both on loopback), form one job."""
    path = script("""
        import modelparallel as mp
        mp.init({"hybrid_shard_degree": 2})
        print("rank", mp.rank(), "of", mp.size(), "local", mp.local_rank(), flush=True)
        mp.barrier()
    """)
    cmd = [sys.executable, "-m", "modelparallel", "run", "--nnodes", "2", "--nproc-per-node",
           "2", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}"]
    nodes = [subprocess.Popen([*cmd, "--node-rank", str(r), str(path)], text=True, env=clean_env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in (0, 1)]
    outs = [n.communicate(timeout=180)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    assert "[rank0]: rank 0 of 4 local 0" in outs[0] and "[rank1]: rank 1 of 4 local 1" in outs[0]
    assert "[rank2]: rank 2 of 4 local 0" in outs[1] and "[rank3]: rank 3 of 4 local 1" in outs[1]


def test_plain_python_is_a_world_of_one(script, clean_env):
    path = script("""
        import torch
        import modelparallel as mp
        mp.init()
        model = mp.shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
        model(torch.randn(2, 4)).sum().backward()
        print("world", mp.size(), mp.rank(), mp.dp_size(), flush=True)
    """)
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          timeout=120, env=clean_env)
    assert proc.returncode == 0, proc.stderr
    assert "world 1 0 1" in proc.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
