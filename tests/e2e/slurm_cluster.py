"""A real two-node SLURM cluster on this machine, for end-to-end tests of a SLURM job backend.

One slurmctld (on 127.0.0.1) and two slurmd daemons of a multiple-slurmd setup
(`slurmd -N node1`, `slurmd -N node2`) whose nodes have the addresses 127.0.0.2 and
127.0.0.3 (Linux routes all of 127.0.0.0/8 to the loopback device). Authentication is a
munged of the cluster's own, with a fresh key and its own socket, so nothing depends on
(or disturbs) the machine's /etc/munge, /etc/slurm or a munged already running there. The
daemons run as root (SlurmUser=root, SlurmdUser=root) without cgroups
(proctrack/linuxproc, task/none) and without accounting.

Files: slurm.conf, the munge key, slurmctld's state and every log are under <workdir>.
Logs, in <workdir>/log: <daemon>.out is what a daemon printed (start-up errors included),
slurmctld.log and slurmd-<node>.log are their log files (the slurmstepd processes of jobs
log into slurmd-<node>.log too), keeper.log says which daemon exited how. munged's socket
and the slurmd spool directories (where slurmd keeps job scripts and the unix sockets of
job steps) are in a short directory of their own under /tmp, <cluster.run_dir>, removed
at teardown: munged insists that every directory above its socket is executable by all
(pytest's /tmp/pytest-of-root is 0700), and a unix socket path holds at most 107 bytes.

All the daemons are started by a keeper process (started first, in a session of its own)
that has made itself a child subreaper (prctl PR_SET_CHILD_SUBREAPER): each slurmstepd,
which slurmd double-forks and which would otherwise become a child of init, and any job
process whose parent dies, becomes a child of the keeper instead. So the cluster's
processes are exactly the keeper's descendants, and the keeper reaps them as they exit
(no zombie waits for init). Teardown closes the keeper's stdin; the keeper then SIGKILLs
its descendants until none is left, and exits. If the process that started the cluster
dies without tearing it down (SIGKILL, a CI timeout), its end of the pipe closes all the
same, and the keeper does the same.

    cluster = start_slurm_cluster(Path(workdir))
    try:
        done = cluster.run("sbatch", "--parsable", "--nodes=2", "job.sh")
        job_id = done.stdout.strip()
        cluster.wait_job(job_id, timeout=60)
    finally:
        stop_slurm_cluster(cluster)

or `with slurm_cluster(workdir) as cluster: ...`, or the module-scoped `slurm` fixture
below (a test module imports it: `from slurm_cluster import slurm_fixture`).

For code that calls sbatch/scontrol with its own environment (os.environ), use
`cluster.use_in(monkeypatch)`, which sets SLURM_CONF and PATH in os.environ.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from procs import alive, comm, stat, tail

if __name__ != "__main__":  # not in the keeper, which starts faster without pytest
    import pytest

NODES = [("node1", "127.0.0.2"), ("node2", "127.0.0.3")]
CONTROLLER_IP = "127.0.0.1"
PARTITION = "debug"
CLUSTER_NAME = "mptest"
# The job states after which a job does not run again (JobState of `scontrol show job`).
ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "PREEMPTED", "BOOT_FAIL", "DEADLINE"})
DAEMONS = ("slurmctld", "slurmd", "munged")
CLIENTS = ("sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")
# The processes of the daemons themselves (slurmscriptd: slurmctld's script runner).
DAEMON_COMMS = frozenset({"slurmctld", "slurmscriptd", "slurmd", "munged"})
# Where Debian puts the daemons (/usr/sbin) and the client commands (/usr/bin).
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Variables that would point the client commands at another cluster or job (when the
# tests themselves run inside a SLURM job, say), or change their defaults.
_FOREIGN_PREFIXES = ("SLURM_", "SLURMD_", "SBATCH_", "SALLOC_", "SRUN_", "SQUEUE_", "SINFO_",
                     "SCONTROL_", "SACCT_", "SCANCEL_")
PR_SET_CHILD_SUBREAPER = 36


@dataclass
class SlurmCluster:
    workdir: Path
    conf: Path  # slurm.conf
    env: dict[str, str]  # a full environment for the client commands (SLURM_CONF, PATH)
    nodes: list[tuple[str, str]]  # (node name, NodeAddr)
    partition: str
    run_dir: Path  # munged's socket and the slurmd spool directories (short, under /tmp)
    munge_socket: Path  # in slurm.conf as AuthInfo=socket=...; libmunge reads no variable
    ports: dict[str, int]  # "slurmctld", "node1", "node2"
    daemons: dict[str, int] = field(default_factory=dict)  # pid by name ("slurmd-node1")
    startup_seconds: float = 0.0
    _keeper: subprocess.Popen | None = None

    @property
    def log_dir(self) -> Path:
        return self.workdir / "log"

    @property
    def node_names(self) -> list[str]:
        return [name for name, _ in self.nodes]

    def node_addr(self, name: str) -> str:
        return dict(self.nodes)[name]

    def run(self, *argv: str, timeout: float = 30, check: bool = False,
            **kwargs) -> subprocess.CompletedProcess:
        """Run a client command (sbatch, squeue, scontrol, scancel, sinfo, srun...) against
        this cluster; text output captured. Raises subprocess.TimeoutExpired after timeout,
        CalledProcessError on failure if check."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run([str(a) for a in argv], env=self.env, timeout=timeout,
                              check=check, **kwargs)

    def use_in(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Point this process's own environment at the cluster (for code under test that
        runs the client commands with os.environ)."""
        for name in list(os.environ):
            if name.startswith(_FOREIGN_PREFIXES):
                monkeypatch.delenv(name)
        monkeypatch.setenv("SLURM_CONF", self.env["SLURM_CONF"])
        monkeypatch.setenv("PATH", self.env["PATH"])

    def sbatch(self, *args: str, timeout: float = 30) -> str:
        """Submit a job (sbatch --parsable ARGS); its id."""
        done = self.run("sbatch", "--parsable", *args, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed ({done.returncode}): "
                               f"{done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str | int) -> dict[str, str]:
        """`scontrol show job -o JOB` as a dict ({} once the controller forgot the job,
        MinJobAge after its end)."""
        done = self.run("scontrol", "show", "job", "-o", str(job_id))
        if done.returncode != 0:
            if "Invalid job id" in done.stderr:
                return {}
            raise RuntimeError(f"scontrol show job {job_id} failed: {done.stderr.strip()}")
        return parse_scontrol(done.stdout)

    def job_state(self, job_id: str | int) -> str:
        """JobState, such as PENDING, RUNNING, COMPLETING, COMPLETED, CANCELLED, FAILED
        ("UNKNOWN" for a job the controller does not know)."""
        return self.job(job_id).get("JobState", "UNKNOWN")

    def wait_job(self, job_id: str | int, timeout: float = 60,
                 states: frozenset[str] | set[str] = ENDED) -> dict[str, str]:
        """Poll `scontrol show job` until the job's state is one of `states` (by default,
        any end); the job's fields then. TimeoutError (with the job) otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job.get("JobState") in states:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not in {sorted(states)} after {timeout} s: "
                                   f"{job}\n{self.log_tails()}")
            time.sleep(0.2)

    def node_states(self) -> dict[str, str]:
        """{node name: sinfo's short state}, e.g. {'node1': 'idle', 'node2': 'alloc'}."""
        done = self.run("sinfo", "--noheader", "--Node", "--format=%N %t", timeout=10)
        states = {}
        for line in done.stdout.splitlines():
            name, _, state = line.strip().partition(" ")
            if name:
                states[name] = state
        return states

    def pids(self) -> list[int]:
        """The live processes of this cluster: daemons, slurmstepd's, job tasks and what
        they started."""
        if self._keeper is None:
            return []
        return _descendants(self._keeper.pid)

    def job_pids(self) -> list[int]:
        """The live processes of jobs (slurmstepd's and everything under them)."""
        return [pid for pid in self.pids() if comm(pid) not in DAEMON_COMMS]

    def log_tails(self, lines: int = 25) -> str:
        parts = []
        for path in sorted(self.log_dir.glob("*")):
            parts.append(f"--- {path.name} (last {lines} lines) ---\n{tail(path, lines)}")
        return "\n".join(parts)


def parse_scontrol(text: str) -> dict[str, str]:
    """The Key=Value pairs of one record of `scontrol show ... -o` (a value may contain
    spaces: it ends where the next ` Key=` starts)."""
    text = text.strip().splitlines()[0] if text.strip() else ""
    return dict(re.findall(r"(?:^|(?<= ))([A-Za-z][\w:/]*?)=(.*?)(?= [A-Za-z][\w:/]*?=|$)",
                           text))


def _free_ports(count: int) -> list[int]:
    """Distinct ports free on every address now (held together so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _processes() -> dict[int, tuple[str, int]]:
    """{pid: (state, parent pid)} of every process."""
    table = {}
    for entry in Path("/proc").iterdir():
        st = stat(int(entry.name)) if entry.name.isdigit() else None
        if st is not None:
            table[int(entry.name)] = st[:2]
    return table


def _descendants(root: int, zombies: bool = False) -> list[int]:
    table = _processes()
    found = {root}
    grew = True
    while grew:
        grew = False
        for pid, (_, parent) in table.items():
            if pid not in found and parent in found:
                found.add(pid)
                grew = True
    found.discard(root)
    return sorted(p for p in found if zombies or table[p][0] != "Z")


def _which(name: str) -> str | None:
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:{_SYSTEM_PATH}")


# --- the keeper: runs as `python slurm_cluster.py --keeper RUN_DIR` ---

def _keeper(run_dir: str) -> int:
    """Start the daemons asked for on stdin (a JSON line each: name, argv, env, log; the
    answer on stdout is the pid), as a child subreaper that reaps whatever becomes its
    child. At the end of stdin, SIGKILL all descendants until none is left, remove the run
    dir, exit (1 if some survived)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(f"prctl(PR_SET_CHILD_SUBREAPER) failed (errno {ctypes.get_errno()}): job "
              "processes will not be found at teardown", file=sys.stderr, flush=True)
    names: dict[int, str] = {}

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                time.sleep(0.05)
                continue
            if pid in names:
                print(f"{names[pid]} (pid {pid}) exited: "
                      f"{os.waitstatus_to_exitcode(status)}", file=sys.stderr, flush=True)

    threading.Thread(target=reap, daemon=True).start()
    for line in sys.stdin:
        try:
            ask = json.loads(line)
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
            pid = os.posix_spawn(ask["argv"][0], ask["argv"], ask["env"], file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                (os.POSIX_SPAWN_OPEN, 1, ask["log"], flags, 0o644),
                (os.POSIX_SPAWN_DUP2, 1, 2)])
            names[pid] = ask["name"]
            print(pid, flush=True)
        except Exception as e:
            print(f"error {e!r}", flush=True)
    deadline = time.monotonic() + 60
    while True:
        left = _descendants(os.getpid(), zombies=True)
        if not left or time.monotonic() > deadline:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    shutil.rmtree(run_dir, ignore_errors=True)
    if left:
        described = ", ".join(f"{pid} ({comm(pid)})" for pid in left)
        print(f"survived SIGKILL: {described}", file=sys.stderr, flush=True)
        return 1
    return 0


def _start_keeper(cluster: SlurmCluster) -> None:
    with open(cluster.log_dir / "keeper.log", "wb") as log:
        cluster._keeper = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--keeper", str(cluster.run_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
            start_new_session=True)


def _spawn(cluster: SlurmCluster, name: str, argv: list[str], env: dict[str, str],
           deadline: float) -> None:
    """Have the keeper start a daemon (output to <log dir>/<name>.out)."""
    keeper = cluster._keeper
    ask = {"name": name, "argv": argv, "env": env, "log": str(cluster.log_dir / f"{name}.out")}
    keeper.stdin.write(json.dumps(ask) + "\n")
    keeper.stdin.flush()
    # At least 10 s: a loaded machine can take seconds to start the keeper's Python.
    wait = max(10.0, deadline - time.monotonic())
    ready, _, _ = select.select([keeper.stdout], [], [], wait)
    answer = keeper.stdout.readline().strip() if ready else f"no answer in {wait:.0f} s"
    if not answer.isdigit():
        raise RuntimeError(f"the keeper could not start {name} ({' '.join(argv)}): {answer}\n"
                           f"{cluster.log_tails()}")
    cluster.daemons[name] = int(answer)


def _slurm_conf(cluster: SlurmCluster, state_dir: Path) -> str:
    w, r, p = cluster.workdir, cluster.run_dir, cluster.ports
    lines = [
        f"ClusterName={CLUSTER_NAME}",
        # "localhost" is accepted as this machine's name whatever its hostname is.
        f"SlurmctldHost=localhost({CONTROLLER_IP})",
        f"SlurmctldPort={p['slurmctld']}",
        f"SlurmdPort={p[cluster.nodes[0][0]]}",  # each node has its own Port= below
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={cluster.munge_socket}",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={state_dir}",
        f"SlurmdSpoolDir={r}/spool/%n",
        f"SlurmctldPidFile={w}/run/slurmctld.pid",
        f"SlurmdPidFile={w}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={w}/log/slurmctld.log",
        f"SlurmdLogFile={w}/log/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobContainerType=job_container/none",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/backfill",
        # Schedule a submitted batch job at the controller's next pass (about once a
        # second) rather than up to 3 s later. The very first pass comes about 3 s after
        # slurmctld started, whatever this says.
        "SchedulerParameters=batch_sched_delay=0",
        "ReturnToService=2",
        # Trust the node lines below rather than the hardware slurmd finds (else a
        # machine with fewer CPUs than configured gets its nodes drained).
        "SlurmdParameters=config_overrides",
        "MinJobAge=3600",  # `scontrol show job` knows ended jobs for an hour
        "KillWait=5",  # SIGTERM to SIGKILL on scancel/time limit (default 30 s)
        "InactiveLimit=0",
        "MailProg=/bin/true",  # the default, /bin/mail, is not installed
    ]
    for name, addr in cluster.nodes:
        lines.append(f"NodeName={name} NodeAddr={addr} NodeHostname=localhost Port={p[name]} "
                     "CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 "
                     "RealMemory=1000 State=UNKNOWN")
    lines.append(f"PartitionName={cluster.partition} Nodes={','.join(cluster.node_names)} "
                 "Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def _check_alive(cluster: SlurmCluster) -> None:
    for name, pid in cluster.daemons.items():
        if not alive(pid):
            time.sleep(0.2)  # for the keeper to log the exit status
            raise RuntimeError(f"{name} exited while the SLURM cluster started\n"
                               f"{cluster.log_tails()}")


def _wait(cluster: SlurmCluster, what: str, ready, deadline: float) -> None:
    while not ready():
        _check_alive(cluster)
        if time.monotonic() > deadline:
            raise TimeoutError(f"SLURM cluster: {what} not ready in time\n"
                               f"{cluster.log_tails()}")
        time.sleep(0.1)


def start_slurm_cluster(workdir: Path, timeout: float = 60) -> SlurmCluster:
    """Start munged, slurmctld and the slurmd of node1 and node2; return once sinfo reports
    both nodes idle (RuntimeError/TimeoutError with the tails of the daemon logs
    otherwise; nothing is left running then)."""
    start = time.monotonic()
    deadline = start + timeout
    workdir = Path(workdir).resolve()
    for sub in ("", "log", "run", "state", "munge"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(workdir / "munge", 0o700)  # munged refuses a key others could change
    ports = _free_ports(1 + len(NODES))
    env = {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN_PREFIXES)}
    env["PATH"] = f"{env['PATH']}:{_SYSTEM_PATH}" if env.get("PATH") else _SYSTEM_PATH
    conf = workdir / "slurm.conf"
    env["SLURM_CONF"] = str(conf)
    run_dir = Path(tempfile.mkdtemp(prefix="mpslurm-", dir="/tmp"))
    cluster = SlurmCluster(
        workdir=workdir, conf=conf, env=env, nodes=list(NODES), partition=PARTITION,
        run_dir=run_dir, munge_socket=run_dir / "munge.sock",
        ports={"slurmctld": ports[0],
               **{name: port for (name, _), port in zip(NODES, ports[1:], strict=True)}})
    try:
        _start_keeper(cluster)
        os.chmod(run_dir, 0o755)  # munged: its socket's directory must be executable by all
        for name, _ in NODES:
            (run_dir / "spool" / name).mkdir(parents=True)
        key = workdir / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        conf.write_text(_slurm_conf(cluster, workdir / "state"))

        _spawn(cluster, "munged", [
            _which("munged") or "/usr/sbin/munged", "--foreground",
            f"--socket={cluster.munge_socket}", f"--key-file={key}",
            f"--seed-file={workdir / 'munge' / 'munged.seed'}",
            f"--pid-file={run_dir / 'munged.pid'}", "--num-threads=2"], env, deadline)
        _wait(cluster, "munged", cluster.munge_socket.exists, deadline)
        _spawn(cluster, "slurmctld", [_which("slurmctld") or "/usr/sbin/slurmctld", "-D",
                                      "-f", str(conf)], env, deadline)
        for name, _ in cluster.nodes:
            _spawn(cluster, f"slurmd-{name}", [_which("slurmd") or "/usr/sbin/slurmd", "-D",
                                               "-N", name, "-f", str(conf)], env, deadline)

        def nodes_idle() -> bool:
            try:
                states = cluster.node_states()
            except subprocess.TimeoutExpired:
                return False
            return all(states.get(name) == "idle" for name in cluster.node_names)

        _wait(cluster, "the nodes (sinfo: idle)", nodes_idle, deadline)
    except BaseException:
        stop_slurm_cluster(cluster)
        raise
    cluster.startup_seconds = time.monotonic() - start
    return cluster


def stop_slurm_cluster(cluster: SlurmCluster, timeout: float = 60) -> None:
    """SIGKILL every process of the cluster (daemons, slurmstepd's, job tasks and what they
    started), wait until none is left (RuntimeError naming survivors otherwise), and remove
    the run dir. Logs and state stay in the workdir."""
    keeper = cluster._keeper
    if keeper is not None:
        with contextlib.suppress(OSError):
            keeper.stdin.close()  # the keeper kills everything, then exits
        try:
            code = keeper.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            keeper.kill()
            keeper.wait()
            code = None
        keeper.stdout.close()
        if code != 0:
            left = cluster.pids()
            raise RuntimeError(f"the SLURM cluster's keeper ended with {code}; processes left: "
                               f"{[(pid, comm(pid)) for pid in left]}\n"
                               f"{tail(cluster.log_dir / 'keeper.log', 25)}")
    shutil.rmtree(cluster.run_dir, ignore_errors=True)


@contextlib.contextmanager
def slurm_cluster(workdir: Path, timeout: float = 60) -> Iterator[SlurmCluster]:
    cluster = start_slurm_cluster(workdir, timeout)
    try:
        yield cluster
    finally:
        stop_slurm_cluster(cluster)


def skip_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return "the SLURM cluster tests need Linux (/proc, the whole 127.0.0.0/8 on loopback)"
    missing = [name for name in (*DAEMONS, *CLIENTS) if _which(name) is None]
    if missing:
        return (f"SLURM/munge not installed (no {', '.join(missing)}); on Debian/Ubuntu: "
                f"apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        return "the SLURM cluster tests run slurmd, which needs root"
    for _, ip in NODES:
        try:
            with socket.socket() as s:
                s.bind((ip, 0))
        except OSError as e:
            return f"cannot bind {ip} ({e}): the two nodes need distinct loopback addresses"
    return None


if __name__ != "__main__":

    @pytest.fixture(scope="module", name="slurm")
    def slurm_fixture(tmp_path_factory) -> Iterator[SlurmCluster]:
        """`slurm`: a two-node SLURM cluster for the tests of one module, killed after them
        (skipped where SLURM or munge is not installed). A test module imports
        `slurm_fixture`."""
        reason = skip_reason()
        if reason:
            pytest.skip(reason)
        with slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
            yield cluster


if __name__ == "__main__" and sys.argv[1:2] == ["--keeper"]:
    sys.exit(_keeper(sys.argv[2]))
