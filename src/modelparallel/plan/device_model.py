"""How fast a device computes and communicates, for the step-time estimate.

``measure_here()`` calibrates this machine with short microbenchmarks (about a second):
the matrix-multiply rate of one thread (a training rank under ``modelparallel run``
has one), a small GPT's training step per tensor operation beyond its arithmetic
(autograd, modules, the optimizer: what a small model's step is made of), and a
loopback socket's throughput and round-trip time (what gloo between ranks of one node
goes through). ``PROFILES`` holds published figures for GPUs, to plan for a machine the
planner is not running on (``--device-profile h100``); they are datasheet numbers, not
measurements, and the estimate says which it used.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceModel:
    """Rates one rank achieves: arithmetic, and a link to its peers."""

    name: str
    flops_per_s: float  # dense matrix multiply, in the training dtype
    link_bytes_per_s: float  # one direction, between two ranks
    link_latency_s: float  # per collective call
    op_overhead_s: float  # per tensor operation, beyond its arithmetic (0: hidden, on a GPU)
    measured: bool  # calibrated here (True) or a datasheet profile

    def describe(self) -> str:
        how = "measured here" if self.measured else "datasheet profile"
        return (f"{self.name} ({how}): {self.flops_per_s / 1e9:.1f} GFLOP/s, "
                f"{self.op_overhead_s * 1e6:.1f} us per operation, link "
                f"{self.link_bytes_per_s / 1e9:.2f} GB/s, {self.link_latency_s * 1e6:.0f} us "
                "per call")


# bf16 dense tensor-core peak; NVLink per direction; a typical NCCL call cost; the host's
# per-operation cost is hidden behind the GPU's work once kernels are queued
PROFILES = {
    "h100": DeviceModel("H100 SXM", 989e12, 450e9, 10e-6, 0.0, False),
    "h200": DeviceModel("H200 SXM", 989e12, 450e9, 10e-6, 0.0, False),
    "a100": DeviceModel("A100 SXM", 312e12, 300e9, 10e-6, 0.0, False),
}


def measure_here(size: int = 512, repeats: int = 5) -> DeviceModel:
    """This machine's CPU, one thread per rank, and loopback TCP (gloo's path)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm-up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        rate = 2 * size ** 3 / best
        overhead = _per_operation(rate)
    finally:
        torch.set_num_threads(threads)
    bandwidth, latency = _loopback()
    return DeviceModel("this machine's CPU (1 thread per rank)", rate, bandwidth, latency,
                       overhead, True)


def _per_operation(flops_per_s: float) -> float:
    """What a training step costs per tensor operation beyond its arithmetic: a small
    GPT's step (autograd, modules, AdamW) timed, its FLOPs' share taken off, divided by
    the operations it ran."""
    from modelparallel.models.gpt import GPT, GPTConfig, lm_loss
    from modelparallel.plan.tracker import StepTracker

    model = GPT(GPTConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=32))
    optimizer = torch.optim.AdamW(model.parameters())
    x, y = torch.randint(0, 256, (4, 32)), torch.randint(0, 256, (4, 32))

    def step() -> None:
        lm_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # the optimizer state
    with StepTracker() as counted:
        step()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return max(0.0, best - counted.flops / flops_per_s) / max(1, counted.ops)


def _loopback(megabytes: int = 32, pings: int = 50) -> tuple[float, float]:
    """Throughput and half round-trip time of a local TCP connection."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    payload = b"\0" * (1 << 20)

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            received = 0
            while received < megabytes << 20:
                received += len(conn.recv(1 << 20))
            conn.sendall(b"k")
            for _ in range(pings):
                conn.sendall(conn.recv(1))

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        for _ in range(megabytes):
            client.sendall(payload)
        client.recv(1)
        bandwidth = (megabytes << 20) / (time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(pings):
            client.sendall(b"p")
            client.recv(1)
        latency = (time.perf_counter() - start) / pings / 2
    thread.join(timeout=5)
    server.close()
    return bandwidth, latency
