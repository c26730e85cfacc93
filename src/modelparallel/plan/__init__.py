"""``modelparallel plan``: will a layout fit, and which layout is fastest, before launch.

The planner simulates every rank's training step on fake tensors and a fake process
group (``dry_run``), with the library's own layout code, and reports per rank the
peak of allocated tensor memory and its parts, the bytes each group's collectives
move, and an estimated step time (``docs/planner.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from modelparallel.plan.dry_run import RankPlan, simulate
from modelparallel.plan.fake_world import NotYetSent, PlanError
from modelparallel.plan.mailbox import ObjectMailbox
from modelparallel.plan.workload import Workload


@dataclass
class JobPlan:
    """Every rank's simulated step."""

    work: Workload
    ranks: list[RankPlan] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"config": dict(self.work.config), "world_size": self.work.world_size,
                "batch_size": self.work.batch_size, "seq_len": self.work.seq_len,
                "optimizer": self.work.optimizer,
                "per_rank": [r.as_dict() for r in self.ranks]}


def plan_job(work: Workload, ranks: list[int] | None = None) -> JobPlan:
    """Simulate the ``ranks`` of ``work`` (all by default; ranks that wait for a later
    rank's objects are simulated again after it). A rank whose experts are split over
    expert-parallel ranks is simulated with the worst routing for its peaks and with a
    balanced one for its collectives and the balanced peak (``plan/experts.py``)."""
    plans = _simulate_ranks(work, ranks, "worst")
    routed = [p.rank for p in plans if p.routing]
    if routed:
        balanced = {p.rank: p for p in _simulate_ranks(work, routed, "balanced")}
        for p in plans:
            if p.rank in balanced:
                expected = balanced[p.rank]
                p.peak_bytes_balanced_routing = expected.peak_bytes
                p.peak_tensor_bytes_balanced_routing = expected.peak_tensor_bytes
                p.comm_bytes, p.comm_calls = expected.comm_bytes, expected.comm_calls
                p.flops, p.ops = expected.flops, expected.ops
    return JobPlan(work, plans)


def _simulate_ranks(work: Workload, ranks: list[int] | None, routing: str) -> list[RankPlan]:
    mailbox = ObjectMailbox()
    done: dict[int, RankPlan] = {}
    pending = list(range(work.world_size)) if ranks is None else sorted(ranks)
    while pending:
        waiting = []
        for rank in pending:
            try:
                done[rank] = simulate(work, rank, mailbox, routing)
            except NotYetSent:
                waiting.append(rank)
        if len(waiting) == len(pending):
            raise PlanError(f"ranks {waiting} wait for each other's objects")
        pending = waiting
    return [done[r] for r in sorted(done)]


__all__ = ["JobPlan", "PlanError", "RankPlan", "Workload", "plan_job"]
