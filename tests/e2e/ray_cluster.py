"""A real two-node Ray cluster on this machine, for end-to-end tests of a Ray job backend.

The head node runs on 127.0.0.2 and the worker node on 127.0.0.3 (Linux routes all of
127.0.0.0/8 to the loopback device, so both addresses work without any setup). Each node
is one `ray start --block` process, started in a new session (setsid):

* everything that node starts (gcs_server, raylet, agents, log monitor, the Python workers
  the raylet forks for tasks and actors, and their children) stays in that session;
* every such process also inherits MP_RAY_CLUSTER=<token of this cluster>.

Teardown SIGKILLs exactly the processes that are in one of this cluster's sessions or
carry its token -- never `ray stop`, which stops every Ray process on the machine (found by
name), other people's clusters included. `ray start --block` is used (rather than a
`ray start` that returns) so that the session leader stays alive while the cluster runs:
its pid, the session id, cannot be taken by a stranger's process in the meantime. With
--block the leader also watches its processes: when the raylet dies, it kills the rest of
its node and exits, so killing one raylet loses the whole node, as a crashed machine would.

If the process that started the cluster dies without tearing it down (SIGKILL, a CI
timeout, os._exit), a janitor does: a small process of its own session, started first,
that waits for the end of a pipe from its parent and then kills the cluster the same way.
(Killing the `ray start` leaders is not enough: Ray's own reaper and fate sharing leave the
dashboard and runtime-env agents running.)

    cluster = start_ray_cluster(Path(workdir))
    try:
        ray.init(address=cluster.address, _node_ip_address=cluster.head_ip)
        ...
        ray.shutdown()
    finally:
        stop_ray_cluster(cluster)

or `with ray_cluster_running(workdir) as cluster: ...`, or the module-scoped `ray_cluster`
fixture below (a test module imports it: `from ray_cluster import ray_cluster_fixture`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from procs import comm, stat, tail

HEAD_IP = "127.0.0.2"
WORKER_IP = "127.0.0.3"
TOKEN_VARIABLE = "MP_RAY_CLUSTER"

# A unix socket path holds at most 107 bytes. Ray puts its sockets at
# <temp dir>/session_<YYYY-MM-DD_HH-MM-SS_ffffff>_<pid of up to 7 digits>/sockets/plasma_store
# (64 bytes after <temp dir>); the node temp dirs are <root>/h and <root>/w.
MAX_TEMP_ROOT = 107 - 64 - 2

# Variables that would point `ray start` or a driver somewhere else.
_FOREIGN = ("RAY_ADDRESS", "RAY_NAMESPACE", "RAY_JOB_CONFIG_JSON_ENV_VAR", "RAY_RUNTIME_ENV")


@dataclass
class RayNode:
    ip: str
    temp_dir: Path
    log: Path
    process: subprocess.Popen  # `ray start --block`, the leader of the node's session

    @property
    def session(self) -> int:
        return self.process.pid


@dataclass
class RayCluster:
    address: str  # "127.0.0.2:PORT", the GCS of the head node
    head_ip: str
    worker_ip: str
    port: int
    temp_dir: Path  # root of the nodes' temp dirs (<temp_dir>/h, <temp_dir>/w)
    env: dict[str, str]  # what a driver process adds to its environment
    node_env: dict[str, str]  # what the nodes' processes got on top of os.environ
    token: str
    nodes: list[RayNode] = field(default_factory=list)
    startup_seconds: float = 0.0
    _own_temp_root: bool = False
    _janitor: subprocess.Popen | None = None

    @property
    def node_ips(self) -> list[str]:
        return [self.head_ip, self.worker_ip]

    def node(self, ip: str) -> RayNode:
        return next(n for n in self.nodes if n.ip == ip)

    def driver_env(self) -> dict[str, str]:
        """A full environment for a driver run as a subprocess (`ray.init()` finds the
        cluster through RAY_ADDRESS)."""
        base = {k: v for k, v in os.environ.items() if k not in _FOREIGN}
        return {**base, **self.env}

    def pids(self) -> list[int]:
        """The live processes of this cluster (zombies left out)."""
        return _cluster_pids({n.session for n in self.nodes}, self.token)

    def raylet_pid(self, ip: str) -> int:
        node = self.node(ip)
        for pid in _cluster_pids({node.session}, None):
            if comm(pid) == "raylet":
                return pid
        raise LookupError(f"no raylet of node {ip} is running")

    def kill_raylet(self, ip: str) -> int:
        """SIGKILL the raylet of one node; its `ray start --block` then kills the rest of
        that node within about a second (processes of Ray's own, not the task workers,
        which exit by themselves when they lose their raylet). Returns the raylet's pid."""
        pid = self.raylet_pid(ip)
        os.kill(pid, signal.SIGKILL)
        return pid

    def kill_node(self, ip: str) -> None:
        """SIGKILL every process of one node at once, as if the machine died."""
        _kill_until_gone({self.node(ip).session}, None, deadline=time.monotonic() + 15)
        self.node(ip).process.wait(timeout=5)

    def alive_node_ips(self, timeout: float = 10) -> list[str]:
        return _alive_node_ips(self.address, timeout)


def _free_port(ip: str) -> int:
    # The GCS listens on all addresses, so the port must be free on all of them.
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _has_token(pid: int, token: str) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{TOKEN_VARIABLE}={token}".encode() in environ.split(b"\0")


def _cluster_pids(sessions: set[int], token: str | None, zombies: bool = False) -> list[int]:
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        st = stat(pid)
        if st is None or (st[0] == "Z" and not zombies):
            continue
        if st[2] in sessions or (token is not None and _has_token(pid, token)):
            found.append(pid)
    return found


def _kill_until_gone(sessions: set[int], token: str | None, deadline: float) -> list[int]:
    """SIGKILL the processes of these sessions (and with this token) until none is left
    or the deadline passes; returns those still alive then."""
    while True:
        pids = _cluster_pids(sessions, token)
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _ray_command() -> list[str]:
    exe = Path(sys.executable).parent / "ray"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("ray")
    if found:
        return [found]
    return [sys.executable, "-c", "from ray.scripts.scripts import main; main()"]


def _alive_node_ips(address: str, timeout: float) -> list[str]:
    """Ask the GCS which nodes are alive, without connecting a driver.

    GcsClient is Ray's own (private) client, the one `ray start` and `ray status` use.
    Only call this once the GCS is up: its constructor waits up to about 40 s for one."""
    from ray._raylet import GcsClient
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    info = GcsClient(address=address).get_all_node_info(timeout=timeout)
    return sorted(n.node_manager_address for n in info.values() if n.state == GcsNodeInfo.ALIVE)


def _start_node(cluster: RayCluster, ip: str, temp_dir: Path, log: Path, args: list[str],
                num_cpus: int, object_store_memory: int) -> RayNode:
    command = [*_ray_command(), "start", "--block", f"--node-ip-address={ip}", *args,
               f"--num-cpus={num_cpus}", f"--object-store-memory={object_store_memory}",
               f"--temp-dir={temp_dir}", "--disable-usage-stats", "--log-style=record",
               "--log-color=false"]
    env = {k: v for k, v in os.environ.items() if k not in _FOREIGN}
    env.update(cluster.node_env)
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, env=env, start_new_session=True)
    node = RayNode(ip=ip, temp_dir=temp_dir, log=log, process=process)
    cluster.nodes.append(node)
    if cluster._janitor is not None:
        with contextlib.suppress(OSError):
            cluster._janitor.stdin.write(f"{node.session}\n".encode())
            cluster._janitor.stdin.flush()
    return node


def _start_janitor(token: str, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--janitor",
                                 token], stdin=subprocess.PIPE, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _janitor(token: str) -> None:
    """Read the cluster's session ids until the end of stdin (the cluster was stopped, or
    the process that started it died), then kill whatever of the cluster is left."""
    sessions = {int(line) for line in sys.stdin if line.strip()}
    left = _kill_until_gone(sessions, token, deadline=time.monotonic() + 60)
    if left:
        print(f"processes of Ray cluster {token} survived SIGKILL: {left}")


def _wait_started(node: RayNode, deadline: float) -> None:
    """Until `ray start` says it started the node (then its GCS/raylet are up)."""
    while True:
        if "Ray runtime started" in node.log.read_text(errors="replace"):
            return
        if node.process.poll() is not None:
            raise RuntimeError(f"`ray start` of node {node.ip} exited with "
                               f"{node.process.returncode}:\n{tail(node.log, 40)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"node {node.ip} did not start in time:\n{tail(node.log, 40)}")
        time.sleep(0.2)


def start_ray_cluster(workdir: Path, timeout: float = 120, *, num_cpus: int = 4,
                      object_store_memory: int = 100 * 1024 * 1024,
                      head_ip: str = HEAD_IP, worker_ip: str = WORKER_IP,
                      env: dict[str, str] | None = None) -> RayCluster:
    """Start a head node on head_ip and a worker node on worker_ip; return once the GCS
    lists both as alive. `env` goes to every process of both nodes (e.g. Ray system
    config as RAY_<name>, such as RAY_health_check_period_ms). The node logs (`ray start`
    output) are <workdir>/head.log and worker.log; Ray's own logs are under the temp dir."""
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    temp_root = workdir / "r"
    own_temp_root = len(str(temp_root)) > MAX_TEMP_ROOT
    if own_temp_root:  # too long for Ray's unix sockets: a short dir of our own
        temp_root = Path(tempfile.mkdtemp(prefix="mpray-", dir="/tmp"))
    start = time.monotonic()
    deadline = start + timeout
    port = _free_port(head_ip)
    token = uuid.uuid4().hex
    node_env = {"RAY_USAGE_STATS_ENABLED": "0", TOKEN_VARIABLE: token,
                # Idle workers started ahead of the first task: 4 Python processes per
                # node that import Ray on a shared 2-core machine, for nothing.
                "RAY_prestart_worker_first_driver": "0", "RAY_enable_worker_prestart": "0",
                **(env or {})}
    cluster = RayCluster(address=f"{head_ip}:{port}", head_ip=head_ip, worker_ip=worker_ip,
                         port=port, temp_dir=temp_root,
                         env={"RAY_ADDRESS": f"{head_ip}:{port}", "RAY_USAGE_STATS_ENABLED": "0"},
                         node_env=node_env, token=token, _own_temp_root=own_temp_root)
    try:
        cluster._janitor = _start_janitor(token, workdir / "janitor.log")
        head = _start_node(cluster, head_ip, temp_root / "h", workdir / "head.log",
                           ["--head", f"--port={port}", "--include-dashboard=false"],
                           num_cpus, object_store_memory)
        _wait_started(head, deadline)
        worker = _start_node(cluster, worker_ip, temp_root / "w", workdir / "worker.log",
                             [f"--address={cluster.address}"], num_cpus, object_store_memory)
        _wait_started(worker, deadline)
        while True:
            alive = _alive_node_ips(cluster.address, timeout=5)
            if alive == sorted([head_ip, worker_ip]):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"alive nodes: {alive}, expected {head_ip} and {worker_ip}")
            time.sleep(0.2)
    except BaseException:
        stop_ray_cluster(cluster)
        raise
    cluster.startup_seconds = time.monotonic() - start
    return cluster


def stop_ray_cluster(cluster: RayCluster, timeout: float = 30) -> None:
    """SIGKILL every process of the cluster and wait until none is left (RuntimeError
    naming the survivors otherwise). No graceful shutdown: nothing of a test cluster is
    worth keeping, and SIGTERM takes raylet and gcs_server many seconds."""
    deadline = time.monotonic() + timeout
    sessions = {n.session for n in cluster.nodes}
    left = _kill_until_gone(sessions, cluster.token, deadline)
    for node in cluster.nodes:  # reap the leaders (our children)
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
    # The processes whose parent died before them linger as zombies until init reaps them
    # (within a second or two here); wait for that, so that `ps` shows nothing either.
    # An init that never reaps must not hold the teardown up, hence the 5 s.
    reaped_by = min(deadline, time.monotonic() + 5)
    while _cluster_pids(sessions, None, zombies=True) and time.monotonic() < reaped_by:
        time.sleep(0.1)
    if cluster._janitor is not None:  # nothing left for it to do: let it go
        with contextlib.suppress(OSError):
            cluster._janitor.stdin.close()
        try:
            cluster._janitor.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            cluster._janitor.kill()
            cluster._janitor.wait()
    if cluster._own_temp_root:
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)
    if left:
        described = ", ".join(f"{pid} ({comm(pid)})" for pid in left)
        raise RuntimeError(f"processes of the Ray cluster survived SIGKILL: {described}")


@contextlib.contextmanager
def ray_cluster_running(workdir: Path, timeout: float = 120, **kwargs) -> Iterator[RayCluster]:
    cluster = start_ray_cluster(workdir, timeout, **kwargs)
    try:
        yield cluster
    finally:
        stop_ray_cluster(cluster)


@contextlib.contextmanager
def ray_driver(cluster: RayCluster, **init_kwargs):
    """This process as the cluster's driver, disconnected on exit (its actors, unless
    detached, die with the job); connect again later, to this cluster or another, as often
    as needed. _node_ip_address picks the head's raylet to attach to (without it Ray picks
    among the raylets it finds running on this machine that belong to the cluster, the head
    first)."""
    import ray

    init_kwargs.setdefault("_node_ip_address", cluster.head_ip)
    sigterm = signal.getsignal(signal.SIGTERM)
    ray.init(address=cluster.address, **init_kwargs)
    try:
        yield ray
    finally:
        ray.shutdown()
        # ray.init installs a SIGTERM handler (sys.exit) that shutdown leaves in place.
        if sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, sigterm)


def skip_reason() -> str | None:
    try:
        import ray  # noqa: F401
    except ImportError as e:
        return f"ray is not installed ({e}); `pip install ray` to run the Ray cluster tests"
    if not sys.platform.startswith("linux"):
        return "the Ray cluster tests need Linux (/proc, the whole 127.0.0.0/8 on loopback)"
    for ip in (HEAD_IP, WORKER_IP):
        try:
            with socket.socket() as s:
                s.bind((ip, 0))
        except OSError as e:
            return f"cannot bind {ip} ({e}): the two nodes need distinct loopback addresses"
    return None


@pytest.fixture(scope="module", name="ray_cluster")
def ray_cluster_fixture(tmp_path_factory) -> Iterator[RayCluster]:
    """`ray_cluster`: a two-node Ray cluster for the tests of one module, killed after them
    (skipped where ray is not installed). A test module imports `ray_cluster_fixture`."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with ray_cluster_running(tmp_path_factory.mktemp("ray")) as cluster:
        yield cluster


if __name__ == "__main__" and sys.argv[1:2] == ["--janitor"]:
    _janitor(sys.argv[2])
