"""How fast a device computes and communicates, for the step-time estimate.

``measure_here()`` calibrates this machine with short microbenchmarks (about a second):
the matrix-multiply rate of one thread (a training rank under ``modelparallel run``
has one), a small GPT's training step per tensor operation beyond its arithmetic
(autograd, modules, the optimizer: what a small model's step is made of), and two gloo
ranks' all-reduce over loopback, large (bandwidth) and small (the cost of a call), in
threads of this process. ``PROFILES`` holds published figures for GPUs, to plan for a machine the
planner is not running on (``--device-profile h100``); they are datasheet numbers, not
measurements, and the estimate says which it used.
"""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


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
    """This machine's CPU, one thread per rank, and gloo between two of its ranks."""
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
    bandwidth, latency = _gloo()
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


def _gloo(megabytes: int = 16, calls: int = 100) -> tuple[float, float]:
    """Two gloo ranks in this process (threads over loopback): the bytes per second of a
    large all-reduce, counted as ``CollectiveCounter`` counts them (2B(n-1)/n = B for two
    ranks), and the time of a small one."""
    store = dist.HashStore()
    found: dict[str, float] = {}

    def rank(r: int) -> None:
        # a gloo backend by itself (its allreduce is the backend API; no default group)
        group: Any = dist.ProcessGroupGloo(store, r, 2, datetime.timedelta(seconds=60))
        small, large = torch.ones(4), torch.ones(megabytes << 18)
        for _ in range(10):
            group.allreduce([small]).wait()
        start = time.perf_counter()
        for _ in range(calls):
            group.allreduce([small]).wait()
        found[f"latency{r}"] = (time.perf_counter() - start) / calls
        group.allreduce([large]).wait()
        start = time.perf_counter()
        for _ in range(3):
            group.allreduce([large]).wait()
        found[f"bandwidth{r}"] = 3 * (megabytes << 20) / (time.perf_counter() - start)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if len(found) < 4:
        from modelparallel.plan.fake_world import PlanError

        raise PlanError("two gloo ranks could not all-reduce on this machine to calibrate "
                        "the link; give --device-profile")
    return min(found["bandwidth0"], found["bandwidth1"]), max(found["latency0"],
                                                              found["latency1"])
