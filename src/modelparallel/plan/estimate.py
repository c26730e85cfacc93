"""The estimated step time of a planned job, from its simulated work and a device model.

Each rank: compute = its counted FLOPs / the device's matrix-multiply rate + its
counted operations x the device's per-operation overhead; communication
= its counted collective bytes / the link's bandwidth + one link latency per call,
assumed not to overlap compute (an upper bound where FSDP prefetches). A pipeline
adds the schedule's ramp: its slowest stage's compute x (m + p - 1) / m for m
microbatches over p stages. The job's step is its slowest rank's. Known blind spots
(docs/planner.md): kernel efficiency below the matmul rate (small or memory-bound
operations), Python overhead, and contention between ranks sharing cores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from modelparallel.plan.device_model import DeviceModel
from modelparallel.plan.dry_run import RankPlan


@dataclass(frozen=True)
class StepEstimate:
    step_s: float
    compute_s: float  # of the slowest rank, with the pipeline's ramp
    comm_s: float
    slowest_rank: int
    device: str

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def estimate_step(ranks: list[RankPlan], device: DeviceModel, pipeline_degree: int,
                  microbatches: int) -> StepEstimate:
    """The step time of the job whose ranks' simulated steps are ``ranks``."""
    ramp = (microbatches + pipeline_degree - 1) / microbatches if pipeline_degree > 1 else 1.0
    best: StepEstimate | None = None
    for r in ranks:
        compute = (r.flops / device.flops_per_s + r.ops * device.op_overhead_s) * ramp
        comm = (sum(r.comm_bytes.values()) / device.link_bytes_per_s
                + sum(r.comm_calls.values()) * device.link_latency_s)
        if best is None or compute + comm > best.step_s:
            best = StepEstimate(compute + comm, compute, comm, r.rank, device.describe())
    assert best is not None, "a job has at least one rank"
    return best
