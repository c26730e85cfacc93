"""What every backend does: start the job's instances, report their output, stop them.

A backend only places ``python -m modelparallel.jobs.instance`` once per instance and
tells each where the rendezvous is; everything else (channels, environment, torchrun,
artifacts) happens inside that command, the same way on every backend.
"""

from __future__ import annotations

import queue
import random
import socket
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from modelparallel.jobs.layout import JobLayout
from modelparallel.jobs.spec import JobSpec


@dataclass
class JobContext:
    """One attempt of a job, as a backend sees it."""

    spec: JobSpec
    layout: JobLayout
    attempt: int
    python: str = field(default_factory=lambda: sys.executable)

    @property
    def rdzv_id(self) -> str:
        return f"{self.spec.name}-{self.attempt}"

    def command(self, index: int | str, rdzv_endpoint: str, local_addr: str) -> list[str]:
        """The instance command; arguments may be shell or Kubernetes variables."""
        return [self.python, "-m", "modelparallel.jobs.instance", str(self.layout.root),
                "--index", str(index), "--rdzv-endpoint", rdzv_endpoint,
                "--local-addr", local_addr, "--rdzv-id", self.rdzv_id]


class Backend(ABC):
    """Runs the instances of one job attempt."""

    name: ClassVar[str]
    options_doc: ClassVar[dict[str, str]] = {}  # backend_options keys -> meaning

    def __init__(self, options: dict[str, Any]):
        self.options = dict(options)
        # why an instance ended without its own result (a lost node), by index
        self.notes: dict[int, str] = {}

    @classmethod
    def check(cls, spec: JobSpec) -> list[tuple[str, str]]:
        """Problems that stop this backend from running ``spec``, as (field, message)."""
        unknown = [k for k in spec.backend_options if k not in cls.options_doc]
        return [(f"backend_options.{k}", f"unknown option for the {cls.name} backend; "
                                         f"options: {', '.join(cls.options_doc) or 'none'}")
                for k in unknown]

    @classmethod
    def missing_tools(cls) -> list[tuple[str, str]]:
        """What this machine lacks to run (not to render) a job on this backend."""
        return []

    def render(self, job: JobContext) -> str:
        """What ``--dry-run`` prints: the script, manifest or commands that would run."""
        return "\n".join(" ".join(job.command(i, "HOST:PORT", "ADDR"))
                         for i in range(job.spec.instance_count))

    @abstractmethod
    def start(self, job: JobContext) -> None:
        """Start every instance; return without waiting for them."""

    @abstractmethod
    def poll(self) -> tuple[list[tuple[int, str]], bool]:
        """New output lines as ``(instance index, line)``, and whether all have ended."""

    @abstractmethod
    def exit_codes(self) -> dict[int, int | None]:
        """Each instance's exit code as the backend saw it (None: unknown/running)."""

    @abstractmethod
    def stop(self) -> None:
        """End every instance (idempotent); poll() reports the end."""

    def info(self) -> dict[str, Any]:
        """Backend-specific identifiers recorded in the job store."""
        return {}

    def close(self) -> None:
        """Release what start() acquired (connections, reservations); the job ended."""
        return None


def drain(lines: queue.Queue) -> list:
    """Everything in ``lines`` now, without waiting."""
    out = []
    while True:
        try:
            out.append(lines.get_nowait())
        except queue.Empty:
            return out


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on every address of this machine, below the range the kernel hands
    out to outgoing connections: a port from that range can be taken by any process's
    connection between this check and the rendezvous store binding it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    candidates = list(range(max(1024, low - 12000), low))
    random.shuffle(candidates)
    for port in candidates[:200]:
        with socket.socket() as s:
            try:
                s.bind(("", port))  # the store listens on every address
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a crowded machine: any port the kernel gives
        s.bind((host, 0))
        return s.getsockname()[1]
