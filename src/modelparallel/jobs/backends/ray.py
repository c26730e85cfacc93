"""Ray: one instance per Ray node, placed by a placement group.

The runner connects to an existing cluster (``backend_options.address``) or starts a
local one, reserves one bundle per instance (STRICT_SPREAD: distinct nodes, when the
cluster has enough), and starts an actor in each bundle that runs the instance command
as a child process. Output is pulled from the actors; an actor whose node is lost ends
its instance as failed with that reason. The jobs directory must be reachable from
every node (one machine, or a shared filesystem).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import time
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from modelparallel.jobs.backends.base import Backend, JobContext, drain, free_port
from modelparallel.jobs.backends.local import loopback_address
from modelparallel.jobs.backends.process import InstanceProcess, end_processes

READ_TIMEOUT_S = 30.0


@ray.remote(max_restarts=0)
class InstanceActor:
    """Runs one instance command on its node and buffers its output."""

    def __init__(self):
        self.instance: InstanceProcess | None = None
        self.lines: queue.Queue[str] = queue.Queue()

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def free_port(self, host: str) -> int:
        return free_port(host)

    def start(self, command: list[str], env: dict[str, str]) -> None:
        if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:  # the GPUs Ray gave this actor
            env = {**env, "CUDA_VISIBLE_DEVICES": os.environ["CUDA_VISIBLE_DEVICES"]}
        self.instance = InstanceProcess(command, env, self.lines)

    def read(self) -> tuple[list[str], int | None]:
        """New output lines, and the exit code once the command ended."""
        code = self.instance.exit_code() if self.instance else None
        return drain(self.lines), code

    def stop(self, grace: float) -> int | None:
        if self.instance is None:
            return None
        end_processes([self.instance], grace)
        return self.instance.proc.returncode


class RayBackend(Backend):
    name = "ray"
    options_doc = {
        "address": "an existing cluster (\"HOST:PORT\" or \"auto\"); default: start a local one",
        "cpus_per_instance": "logical CPUs each instance reserves (default 1)",
        "gpus_per_instance": "GPUs each instance reserves (default 0)",
        "placement_timeout_s": "how long to wait for the nodes (default 120)",
        "stop_grace_s": "seconds between SIGTERM and SIGKILL on stop (10)",
    }

    def __init__(self, options: dict[str, Any]):
        super().__init__(options)
        self.actors: list[Any] = []
        self.codes: dict[int, int | None] = {}
        self.pg = None
        self.strategy = ""
        self.pending: dict[int, Any] = {}  # index -> read() in flight
        self.sent_at: dict[int, float] = {}

    def _connect(self) -> None:
        if not ray.is_initialized():
            address = self.options.get("address")
            handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
            ray.init(address=address, log_to_driver=False, configure_logging=False,
                     include_dashboard=False if address is None else None)
            for sig, handler in handlers.items():  # ray.init replaces the runner's
                signal.signal(sig, handler)

    def start(self, job: JobContext) -> None:
        spec = job.spec
        self._connect()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        bundle = {"CPU": float(self.options.get("cpus_per_instance", 1))}
        if self.options.get("gpus_per_instance"):
            bundle["GPU"] = float(self.options["gpus_per_instance"])
        # distinct nodes where the cluster has enough; else all on one (a local cluster)
        self.strategy = "STRICT_SPREAD" if len(nodes) >= spec.instance_count else "PACK"
        self.pg = pg = placement_group([dict(bundle)] * spec.instance_count,
                                       strategy=self.strategy)
        timeout = float(self.options.get("placement_timeout_s", 120))
        try:
            ray.get(pg.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"Ray could not place {spec.instance_count} instance(s) of {bundle} with "
                f"{self.strategy} within {timeout:g}s ({len(nodes)} alive node(s)); add "
                f"nodes or lower cpus_per_instance/gpus_per_instance") from None
        actors = [InstanceActor.options(  # type: ignore[attr-defined]  # a Ray actor class
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=i)).remote()
            for i in range(spec.instance_count)]
        ips = ray.get([a.node_ip.remote() for a in actors], timeout=timeout)
        if len(set(ips)) == len(ips):  # instances numbered in address order (c10d's)
            order = sorted(range(len(ips)), key=lambda i: ips[i])
            self.actors = [actors[i] for i in order]
            addrs = [ips[i] for i in order]
        elif len(set(ips)) == 1:  # one node: its loopback addresses, as the local backend
            self.actors, addrs = actors, [loopback_address(i) for i in range(len(ips))]
        else:
            raise RuntimeError(f"Ray placed the instances on nodes {ips}: some share a node "
                               f"and some do not; give every instance its own node")
        self.addrs = addrs
        port = ray.get(self.actors[0].free_port.remote(addrs[0]), timeout=timeout)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("RAY_") and k != "CUDA_VISIBLE_DEVICES"}
        env["PYTHONUNBUFFERED"] = "1"
        ray.get([a.start.remote(job.command(i, f"{addrs[0]}:{port}", addrs[i]), env)
                 for i, a in enumerate(self.actors)], timeout=timeout)
        self.codes = {i: None for i in range(len(self.actors))}

    def info(self) -> dict[str, Any]:
        return {"ray_strategy": self.strategy, "addresses": getattr(self, "addrs", []),
                "placement_group": self.pg.id.hex() if self.pg else None}

    def poll(self) -> tuple[list[tuple[int, str]], bool]:
        out: list[tuple[int, str]] = []
        now = time.monotonic()
        for i, actor in enumerate(self.actors):
            if self.codes[i] is not None:
                continue
            if i not in self.pending:
                self.pending[i], self.sent_at[i] = actor.read.remote(), now
            ready, _ = ray.wait([self.pending[i]], timeout=0)
            if not ready:
                if now - self.sent_at[i] > READ_TIMEOUT_S:
                    self._lost(i, f"its Ray actor did not answer for {READ_TIMEOUT_S:g}s")
                continue
            ref = self.pending.pop(i)
            try:
                lines, code = ray.get(ref)
            except ray.exceptions.RayError as e:  # the node, or the actor, is gone
                self._lost(i, f"{type(e).__name__}: {str(e).splitlines()[0]}")
                continue
            out += [(i, line) for line in lines]
            self.codes[i] = code
        done = all(c is not None for c in self.codes.values())
        return out, done

    def _lost(self, index: int, why: str) -> None:
        self.codes[index] = -1
        self.pending.pop(index, None)
        self.notes[index] = f"instance algo-{index + 1} lost its Ray node: {why}"

    def exit_codes(self) -> dict[int, int | None]:
        return dict(self.codes)

    def stop(self) -> None:
        grace = float(self.options.get("stop_grace_s", 10))
        refs = [a.stop.remote(grace) for i, a in enumerate(self.actors)
                if self.codes.get(i) is None]
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(refs, timeout=grace + 30)

    def close(self) -> None:
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        if self.pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
        if ray.is_initialized():
            ray.shutdown()
