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
    rank's objects are simulated again after it)."""
    mailbox = ObjectMailbox()
    done: dict[int, RankPlan] = {}
    pending = list(range(work.world_size)) if ranks is None else sorted(ranks)
    while pending:
        waiting = []
        for rank in pending:
            try:
                done[rank] = simulate(work, rank, mailbox)
            except NotYetSent:
                waiting.append(rank)
        if len(waiting) == len(pending):
            raise PlanError(f"ranks {waiting} wait for each other's objects")
        pending = waiting
    return JobPlan(work, [done[r] for r in sorted(done)])


__all__ = ["JobPlan", "PlanError", "RankPlan", "Workload", "plan_job"]
