"""The default backend: ``instance_count`` instances on this machine, each its own
torchrun agent on its own loopback address, joined by a c10d rendezvous as separate
nodes would be."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import threading
import time

from modelparallel.jobs.backends.base import Backend, JobContext, drain, free_port


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
        self.procs: list[subprocess.Popen] = []
        self.lines: queue.Queue[tuple[int, str]] = queue.Queue()
        self.readers: list[threading.Thread] = []

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
            proc = subprocess.Popen(job.command(index, endpoint, loopback_address(index)),
                                    env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    text=True, errors="replace", bufsize=1)
            self.procs.append(proc)
            reader = threading.Thread(target=self._read, args=(index, proc), daemon=True)
            reader.start()
            self.readers.append(reader)

    def _read(self, index: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.put((index, line.rstrip("\n")))

    def poll(self) -> tuple[list[tuple[int, str]], bool]:
        done = all(p.poll() is not None for p in self.procs) and \
            not any(r.is_alive() for r in self.readers)
        return drain(self.lines), done

    def exit_codes(self) -> dict[int, int | None]:
        return {i: p.poll() for i, p in enumerate(self.procs)}

    def stop(self) -> None:
        """SIGTERM every instance's process group (the agent and its workers), then
        SIGKILL what is left after the grace period."""
        grace = float(self.options.get("stop_grace_s", 10))
        for p in self.procs:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            _signal_group(p, signal.SIGKILL)  # stragglers of the group, even after exit
            p.wait()


def visible_gpus() -> list[str]:
    """The CUDA devices this process may use (CUDA_VISIBLE_DEVICES' entries or indices)."""
    import torch

    if not torch.cuda.is_available():
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed:
        return [d.strip() for d in listed.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
