"""The two-node SLURM cluster of slurm_cluster.py works as a SLURM job backend needs it to:
a 2-node batch job runs one srun task per node, each task finds its node's address, the
job finds the first node's; scancel ends a running job and its processes; a second cluster
runs beside the first; nothing is left behind, even when the starting process dies."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import slurm_cluster as slurm_cluster_module
from procs import alive, comm, processes_naming
from slurm_cluster import (
    NODES,
    SlurmCluster,
    _descendants,
    skip_reason,
    slurm_cluster,
    slurm_fixture,  # noqa: F401  (the module-scoped fixture `slurm`)
    start_slurm_cluster,
)

if skip_reason():
    pytest.skip(skip_reason(), allow_module_level=True)

HERE = Path(__file__).resolve().parent

# What a job script does to learn addresses: node names do not resolve (no DNS, no
# /etc/hosts entries), so ask the controller for the node's NodeAddr.
ADDR_OF = "addr_of() { scontrol show node \"$1\" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p'; }"


def _write_job(cluster: SlurmCluster, name: str, body: str) -> Path:
    jobs = cluster.workdir / "jobs"
    jobs.mkdir(exist_ok=True)
    path = jobs / name
    path.write_text("#!/bin/bash\n" + textwrap.dedent(body))
    return path


def _wait_for(what: str, check, timeout: float, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(interval)


@pytest.mark.timeout(120)  # the first test of the module also starts the cluster
def test_cluster_is_up(slurm: SlurmCluster):
    print(f"cluster started in {slurm.startup_seconds:.1f} s")
    assert slurm.nodes == [("node1", "127.0.0.2"), ("node2", "127.0.0.3")]
    assert slurm.node_states() == {"node1": "idle", "node2": "idle"}
    assert slurm.env["SLURM_CONF"] == str(slurm.conf)
    partitions = slurm.run("sinfo", "--noheader", "--format=%P %D", check=True).stdout.split()
    assert partitions == [f"{slurm.partition}*", "2"]
    for name, addr in NODES:
        node = slurm.run("scontrol", "show", "node", "-o", name, check=True).stdout
        assert f"NodeAddr={addr} " in node
    # The cluster's own munged: the machine's is neither used nor needed.
    assert f"AuthInfo=socket={slurm.munge_socket}" in slurm.conf.read_text()
    assert slurm.munge_socket.is_socket()


@pytest.mark.timeout(120)
def test_two_node_batch_job_runs_one_task_per_node(slurm: SlurmCluster):
    out = slurm.workdir / "jobs" / "two_nodes.out"
    script = _write_job(slurm, "two_nodes.sh", f"""\
        set -euo pipefail
        {ADDR_OF}
        export -f addr_of
        echo "hostnames: $(scontrol show hostnames "$SLURM_JOB_NODELIST" | tr '\\n' ' ')"
        first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
        echo "first: $first $(addr_of "$first")"
        echo "batch: $SLURMD_NODENAME $(addr_of "$SLURMD_NODENAME")"
        srun bash -c 'echo "task: $SLURMD_NODENAME $SLURM_NODEID $SLURM_PROCID \\
        $(addr_of "$SLURMD_NODENAME")"; env | grep -E "^SLURMD?_" | sort \\
        > "{out}.env.$SLURM_PROCID"'
        """)
    start = time.monotonic()
    done = slurm.run("sbatch", "--nodes=2", "--ntasks-per-node=1", "--wait", f"--output={out}",
                     script, timeout=90)
    seconds = time.monotonic() - start
    print(f"sbatch --wait returned after {seconds:.1f} s")
    text = out.read_text() if out.exists() else "(no output file)"
    assert done.returncode == 0, f"{done.stdout}{done.stderr}\n{text}\n{slurm.log_tails()}"
    job_id = done.stdout.split()[-1]  # "Submitted batch job N"
    lines = text.splitlines()
    assert "hostnames: node1 node2 " in lines, text
    assert "first: node1 127.0.0.2" in lines, text
    assert "batch: node1 127.0.0.2" in lines, text  # the batch script runs on the first node
    tasks = sorted(line.split()[1:] for line in lines if line.startswith("task: "))
    assert tasks == [["node1", "0", "0", "127.0.0.2"], ["node2", "1", "1", "127.0.0.3"]], text

    # What srun gives each task.
    for rank, node in enumerate(("node1", "node2")):
        env = dict(line.split("=", 1) for line in Path(f"{out}.env.{rank}").read_text()
                   .splitlines())
        assert env["SLURMD_NODENAME"] == node
        assert env["SLURM_NODEID"] == env["SLURM_PROCID"] == str(rank)
        assert env["SLURM_LOCALID"] == "0"
        assert env["SLURM_NTASKS"] == env["SLURM_NNODES"] == env["SLURM_JOB_NUM_NODES"] == "2"
        assert env["SLURM_JOB_NODELIST"] == env["SLURM_STEP_NODELIST"] == "node[1-2]"
        assert env["SLURM_JOB_ID"] == job_id
        assert env["SLURM_STEP_ID"] == "0"
        assert env["SLURM_CONF"] == str(slurm.conf)
        assert env["SLURM_TOPOLOGY_ADDR"] == node  # a node *name*, despite its name
        assert env["SLURM_LAUNCH_NODE_IPADDR"] == "127.0.0.1"  # srun's, not the node's

    # Without accounting, scontrol (for MinJobAge after the end) says how the job ended.
    job = slurm.job(job_id)
    assert job["JobState"] == "COMPLETED", job
    assert job["ExitCode"] == "0:0"
    assert job["NodeList"] == "node[1-2]" and job["BatchHost"] == "node1"
    _wait_for("nodes idle again", lambda: slurm.node_states() == {"node1": "idle",
                                                                   "node2": "idle"}, 30)


@pytest.mark.timeout(120)
def test_scancel_ends_a_running_two_node_job(slurm: SlurmCluster):
    jobs = slurm.workdir / "jobs"
    marker = jobs / "cancel-me"
    # exec -a: the tasks' command lines name the marker, to look for them afterwards.
    script = _write_job(slurm, "cancel.sh", f"""\
        srun bash -c 'echo $$ > "{marker}.pid.$SLURM_PROCID"; exec -a "sleep-{marker}" sleep 300'
        """)
    job_id = slurm.sbatch("--nodes=2", "--ntasks-per-node=1", f"--output={jobs}/cancel.out",
                          str(script))
    slurm.wait_job(job_id, timeout=60, states={"RUNNING"})
    pid_files = [Path(f"{marker}.pid.{rank}") for rank in range(2)]
    _wait_for("both tasks started", lambda: all(f.exists() and f.read_text().strip()
                                                for f in pid_files), 60)
    task_pids = [int(f.read_text()) for f in pid_files]
    assert all(alive(pid) for pid in task_pids)
    assert set(task_pids) <= set(slurm.job_pids())
    squeue = slurm.run("squeue", "--noheader", "--jobs", job_id, "--format=%i %t %D %N",
                       check=True).stdout.split()
    assert squeue == [job_id, "R", "2", "node[1-2]"]

    start = time.monotonic()
    slurm.run("scancel", job_id, check=True)
    job = slurm.wait_job(job_id, timeout=30)
    assert job["JobState"] == "CANCELLED", job
    _wait_for("job processes gone", lambda: not slurm.job_pids(), 30)
    print(f"CANCELLED and all job processes gone {time.monotonic() - start:.1f} s after scancel")
    assert not any(alive(pid) for pid in task_pids)
    assert processes_naming(f"sleep-{marker}") == []
    _wait_for("nodes idle again", lambda: slurm.node_states() == {"node1": "idle",
                                                                   "node2": "idle"}, 30)


@pytest.mark.timeout(120)
def test_second_cluster_beside_the_first_and_nothing_left(slurm: SlurmCluster, tmp_path):
    with slurm_cluster(tmp_path / "second") as other:
        assert other.ports.keys() == slurm.ports.keys()
        assert not set(other.ports.values()) & set(slurm.ports.values())
        done = other.run("srun", "--nodes=2", "--ntasks-per-node=1", "--label",
                         "printenv", "SLURMD_NODENAME", timeout=60)
        assert done.returncode == 0, done.stderr
        assert sorted(done.stdout.splitlines()) == ["0: node1", "1: node2"]
        pids = other.pids()
        assert pids
        assert not set(pids) & set(slurm.pids())
    assert not any(alive(pid) for pid in pids)
    assert other.pids() == []
    assert not other.run_dir.exists()
    assert processes_naming(str(other.conf)) == []
    # The first cluster still works.
    assert slurm.node_states() == {"node1": "idle", "node2": "idle"}


@pytest.mark.timeout(120)
def test_cluster_killed_when_its_starter_dies(tmp_path):
    """A process that starts a cluster and is SIGKILLed: the keeper kills the cluster."""
    code = textwrap.dedent(f"""\
        import sys, time
        sys.path.insert(0, {str(HERE)!r})
        from pathlib import Path
        from slurm_cluster import start_slurm_cluster
        c = start_slurm_cluster(Path({str(tmp_path)!r}))
        c.sbatch("--nodes=2", "--output=/dev/null", "--wrap", "srun sleep 300")
        print(c._keeper.pid, c.run_dir, flush=True)
        time.sleep(300)
        """)
    starter = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        line = starter.stdout.readline()
        assert line, "the starter died before the cluster was up"
        keeper, run_dir = line.split()
        keeper_pid = int(keeper)

        def tasks_running() -> list[int] | None:
            pids = _descendants(keeper_pid)  # the cluster's processes
            return pids if [comm(p) for p in pids].count("sleep") == 2 else None

        pids = _wait_for("the job's tasks running", tasks_running, 60)
        assert {"munged", "slurmctld", "slurmd", "slurmstepd"} <= {comm(p) for p in pids}
    finally:
        starter.send_signal(signal.SIGKILL)
        starter.wait(timeout=30)
        starter.stdout.close()
    _wait_for("keeper gone", lambda: not alive(keeper_pid), 60)
    assert not any(alive(pid) for pid in pids)
    assert processes_naming(str(tmp_path / "slurm.conf")) == []
    assert not Path(run_dir).exists()


@pytest.mark.timeout(60)
def test_daemon_that_dies_at_start_is_reported_with_its_log(tmp_path, monkeypatch):
    real = slurm_cluster_module._slurm_conf
    monkeypatch.setattr(slurm_cluster_module, "_slurm_conf",
                        lambda *args: real(*args) + "NoSuchParameter=1\n")
    run_dirs = []
    real_mkdtemp = slurm_cluster_module.tempfile.mkdtemp
    monkeypatch.setattr(slurm_cluster_module.tempfile, "mkdtemp",
                        lambda **kw: run_dirs.append(real_mkdtemp(**kw)) or run_dirs[-1])
    with pytest.raises(RuntimeError) as raised:
        start_slurm_cluster(tmp_path, timeout=30)
    message = str(raised.value)
    print(message)
    assert "exited while the SLURM cluster started" in message
    assert "NoSuchParameter" in message  # slurmctld's (or slurmd's) complaint, from its log
    assert processes_naming(str(tmp_path)) == []
    assert len(run_dirs) == 1 and not Path(run_dirs[0]).exists()


@pytest.mark.timeout(60)
def test_start_timeout_says_why_and_leaves_nothing(tmp_path, monkeypatch):
    """A munged that never makes its socket: TimeoutError after `timeout`, then nothing of
    the cluster is left running."""
    fake = tmp_path / "fake-munged"
    fake.write_text("#!/bin/sh\nexec sleep 300\n")
    fake.chmod(0o755)
    real = slurm_cluster_module._which
    monkeypatch.setattr(slurm_cluster_module, "_which",
                        lambda name: str(fake) if name == "munged" else real(name))
    start = time.monotonic()
    with pytest.raises(TimeoutError) as raised:
        start_slurm_cluster(tmp_path / "cluster", timeout=3)
    assert time.monotonic() - start < 30
    assert "munged not ready in time" in str(raised.value)
    assert "--- munged.out" in str(raised.value)  # the tails of the logs
    assert processes_naming(str(fake)) == []
    assert processes_naming(str(tmp_path)) == []
