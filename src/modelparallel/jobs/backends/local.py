"""The default backend: ``instance_count`` instances on this machine, each its own
torchrun agent on its own loopback address, joined by a c10d rendezvous as separate
nodes would be."""

from __future__ import annotations

import os
import queue

from modelparallel.jobs.backends.base import Backend, JobContext, drain, free_port
from modelparallel.jobs.backends.process import InstanceProcess, end_processes


def loopback_address(index: int) -> str:
    """Instance ``index``'s address: 127.0.1.100, 127.0.1.101, ... (all on ``lo``).

    torchrun's c10d rendezvous numbers nodes in the string order of their addresses;
    these sort in instance order, so instance 0 (algo-1) holds global rank 0.
    """
    return f"127.0.{1 + index // 100}.{100 + index % 100}"


class LocalBackend(Backend):
    name = "local"
    options_doc = {"stop_grace_s": "seconds between SIGTERM and SIGKILL on stop (10)"}

    def __init__(self, options):
        super().__init__(options)
        self.instances: list[InstanceProcess] = []
        self.lines: queue.Queue[tuple[int, str]] = queue.Queue()

    @classmethod
    def check(cls, spec) -> list[tuple[str, str]]:
        problems = super().check(spec)
        gpus = visible_gpus()
        if gpus and spec.world_size > len(gpus):
            problems.append(("processes_per_host", f"{spec.instance_count} instance(s) x "
                             f"{spec.processes_per_host} = {spec.world_size} processes need as "
                             f"many GPUs; this machine has {len(gpus)}"))
        return problems

    def render(self, job: JobContext) -> str:
        return "\n".join(" ".join(job.command(i, f"{loopback_address(0)}:PORT",
                                               loopback_address(i)))
                         for i in range(job.spec.instance_count))

    def start(self, job: JobContext) -> None:
        host = loopback_address(0)
        endpoint = f"{host}:{free_port(host)}"
        gpus, pph = visible_gpus(), job.spec.processes_per_host
        for index in range(job.spec.instance_count):
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            if gpus:  # each instance its own GPUs, as each node would have
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[index * pph:(index + 1) * pph])
            self.instances.append(InstanceProcess(
                job.command(index, endpoint, loopback_address(index)), env, self.lines,
                tag=index))

    def poll(self) -> tuple[list[tuple[int, str]], bool]:
        done = all(p.ended for p in self.instances)
        return drain(self.lines), done

    def exit_codes(self) -> dict[int, int | None]:
        return {i: p.proc.poll() for i, p in enumerate(self.instances)}

    def stop(self) -> None:
        """SIGTERM every instance's process group (the agent and its workers), then
        SIGKILL what is left after the grace period."""
        end_processes(self.instances, float(self.options.get("stop_grace_s", 10)))


def visible_gpus() -> list[str]:
    """The CUDA devices this process may use (CUDA_VISIBLE_DEVICES' entries or indices)."""
    import torch

    if not torch.cuda.is_available():
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed:
        return [d.strip() for d in listed.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]

