"""The two-node Ray cluster of ray_cluster.py works as a Ray job backend needs it to:
actors placed one per node, a child process inside an actor streamed to the driver and
killed through the actor, a lost node reported to the driver, and nothing left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import processes_naming
from ray_cluster import (
    HEAD_IP,
    WORKER_IP,
    RayCluster,
    ray_cluster_fixture,  # noqa: F401  (the module-scoped fixture `ray_cluster`)
    ray_cluster_running,
    ray_driver,
    skip_reason,
)

if skip_reason():
    pytest.skip(skip_reason(), allow_module_level=True)

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

# Ray's system config for the GCS's health checks of the raylets, by environment (RAY_<name>).
# The defaults (period 3000 ms, timeout 10000 ms, 5 misses) declare a node dead about 15 s
# after its raylet died; these do it in about 3 s, and still leave a loaded raylet a second
# per check.
FAST_NODE_DEATH = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}


@ray.remote(num_cpus=1)
class Probe:
    """One per node: says where it runs, and runs a child process for the driver."""

    def __init__(self):
        self.child: subprocess.Popen | None = None
        self.pending = b""

    def where(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), os.getpid()

    def start_child(self, code: str) -> int:
        self.child = subprocess.Popen([sys.executable, "-u", "-c", code],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        os.set_blocking(self.child.stdout.fileno(), False)
        return self.child.pid

    def read_new_lines(self) -> list[str]:
        """The complete lines the child printed since the last call (never blocks)."""
        fd = self.child.stdout.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not chunk:  # end of file: the child closed its output
                break
            self.pending += chunk
        *lines, self.pending = self.pending.split(b"\n")
        return [line.decode() for line in lines]

    def kill_child(self) -> int:
        self.child.kill()
        return self.child.wait(timeout=30)

    def sleep(self, seconds: float) -> str:
        time.sleep(seconds)
        return "slept"


@pytest.mark.timeout(180)  # the first test of the module also starts the cluster
def test_two_nodes_on_distinct_loopback_addresses(ray_cluster: RayCluster):
    assert ray_cluster.address == f"{HEAD_IP}:{ray_cluster.port}"
    assert ray_cluster.alive_node_ips() == [HEAD_IP, WORKER_IP]
    assert ray_cluster.node_ips == [HEAD_IP, WORKER_IP]
    assert ray_cluster.pids()
    for ip in ray_cluster.node_ips:
        assert ray_cluster.raylet_pid(ip) in ray_cluster.pids()


@pytest.mark.timeout(120)
def test_strict_spread_places_one_actor_per_node(ray_cluster: RayCluster):
    with ray_driver(ray_cluster):
        pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
        ray.get(pg.ready(), timeout=60)
        probes = [Probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=i)).remote() for i in range(2)]
        where = ray.get([p.where.remote() for p in probes], timeout=60)
        assert {ip for ip, _ in where} == {HEAD_IP, WORKER_IP}
        # Both run on this machine, as two processes.
        assert all(Path(f"/proc/{pid}").exists() for _, pid in where)
        for p in probes:
            ray.kill(p)
        remove_placement_group(pg)


CHILD = "import itertools, time\nfor i in itertools.count():\n    print('line', i)\n" \
        "    time.sleep(0.05)\n"


@pytest.mark.timeout(120)
def test_child_process_of_an_actor_streamed_and_killed(ray_cluster: RayCluster):
    with ray_driver(ray_cluster):
        probe = Probe.options(resources={f"node:{WORKER_IP}": 0.01}).remote()
        assert ray.get(probe.where.remote(), timeout=60)[0] == WORKER_IP
        child = ray.get(probe.start_child.remote(CHILD), timeout=60)
        batches: list[list[str]] = []
        deadline = time.monotonic() + 60
        while sum(1 for b in batches if b) < 3:  # three reads that each found new lines
            assert time.monotonic() < deadline, f"only {batches} after 60 s"
            batches.append(ray.get(probe.read_new_lines.remote(), timeout=30))
            time.sleep(0.2)
        lines = [line for batch in batches for line in batch]
        # Incremental: each line once, in order, none lost between the calls.
        assert lines == [f"line {i}" for i in range(len(lines))]
        assert Path(f"/proc/{child}").exists()  # same machine: the driver can look

        assert ray.get(probe.kill_child.remote(), timeout=30) == -9
        assert not Path(f"/proc/{child}").exists()  # reaped by the actor
        # Whatever it printed before dying still comes, then nothing more.
        rest = ray.get(probe.read_new_lines.remote(), timeout=30)
        assert rest == [f"line {i}" for i in range(len(lines), len(lines) + len(rest))]
        assert ray.get(probe.read_new_lines.remote(), timeout=30) == []
        ray.kill(probe)


@pytest.mark.timeout(120)
def test_driver_in_a_subprocess_finds_the_cluster_through_ray_address(ray_cluster: RayCluster):
    code = ("import ray\nray.init(log_to_driver=False)\n"
            "print(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']))\n"
            "print(ray.get(ray.remote(lambda: ray.util.get_node_ip_address())"
            ".options(resources={'node:127.0.0.3': 0.01}).remote()))\n")
    run = subprocess.run([sys.executable, "-c", code], env=ray_cluster.driver_env(),
                         capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-2:] == [str([HEAD_IP, WORKER_IP]), WORKER_IP]


def _call_while_node_dies(cluster: RayCluster, kill) -> tuple[BaseException, float, Probe]:
    """Start a long call on an actor of the worker node, kill that node with kill(), and
    return the exception the driver got for the call, and how long after the kill."""
    probe = Probe.options(resources={f"node:{WORKER_IP}": 0.01}).remote()
    assert ray.get(probe.where.remote(), timeout=60)[0] == WORKER_IP
    call = probe.sleep.remote(300)
    time.sleep(0.5)  # the call has reached the actor
    start = time.monotonic()
    kill(WORKER_IP)
    with pytest.raises(ray.exceptions.RayActorError) as raised:
        ray.get(call, timeout=60)
    return raised.value, time.monotonic() - start, probe


def _wait_actor_died(probe: Probe, within: float) -> tuple[ray.exceptions.ActorDiedError, float]:
    """Call the actor until Ray says it died (not merely unavailable); the error and when."""
    start = time.monotonic()
    while True:
        try:
            ray.get(probe.where.remote(), timeout=within)
        except ray.exceptions.ActorDiedError as e:
            return e, time.monotonic() - start
        except ray.exceptions.ActorUnavailableError:
            assert time.monotonic() - start < within
            time.sleep(0.2)
        else:
            pytest.fail("the actor of the lost node still answered")


def _assert_nothing_left(cluster: RayCluster):
    assert cluster.pids() == []
    assert processes_naming(str(cluster.temp_dir), zombies=True) == []
    for node in cluster.nodes:
        assert node.process.poll() is not None


@pytest.mark.extended  # long fault test
@pytest.mark.timeout(240)
def test_lost_node_with_default_health_checks(tmp_path_factory):
    """Default settings: the call in flight fails within seconds with ActorUnavailableError
    (the actor's connection broke; the actor may come back, as far as the driver knows);
    only after the GCS has missed 5 health checks of 3 s is the actor dead (ActorDiedError,
    'its node has died')."""
    with ray_cluster_running(tmp_path_factory.mktemp("ray")) as cluster, ray_driver(cluster):
        error, seconds, probe = _call_while_node_dies(cluster, cluster.kill_raylet)
        assert isinstance(error, ray.exceptions.ActorUnavailableError), repr(error)
        assert seconds < 15
        died, later = _wait_actor_died(probe, within=60)
        print(f"{type(error).__name__} after {seconds:.1f} s, ActorDiedError after "
              f"{seconds + later:.1f} s")
        assert "node has died" in str(died)
        assert seconds + later > 8  # 5 missed checks, 3 s apart
        assert WORKER_IP not in cluster.alive_node_ips()
        assert cluster.node(WORKER_IP).process.wait(timeout=30) != 0  # `ray start` saw it
    _assert_nothing_left(cluster)


@pytest.mark.extended  # long fault test
@pytest.mark.timeout(240)
def test_lost_node_with_fast_health_checks(tmp_path_factory):
    """With FAST_NODE_DEATH the call in flight fails with ActorDiedError directly, within a
    few seconds of the whole worker node being killed (as if its machine went away)."""
    with ray_cluster_running(tmp_path_factory.mktemp("ray"), env=FAST_NODE_DEATH) as cluster, \
            ray_driver(cluster):
        error, seconds, probe = _call_while_node_dies(cluster, cluster.kill_node)
        if isinstance(error, ray.exceptions.ActorUnavailableError):  # a slow health check
            error, later = _wait_actor_died(probe, within=30)
            seconds += later
        print(f"{type(error).__name__} after {seconds:.1f} s")
        assert isinstance(error, ray.exceptions.ActorDiedError), repr(error)
        assert "node has died" in str(error)
        assert seconds < 10
        assert WORKER_IP not in cluster.alive_node_ips()
        # The head node goes on: new work lands there.
        assert ray.get(Probe.remote().where.remote(), timeout=60)[0] == HEAD_IP
    _assert_nothing_left(cluster)
