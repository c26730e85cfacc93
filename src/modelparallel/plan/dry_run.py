"""One rank's training step, simulated: the real layout code (``mp.init``, the
appliers, the pipeline schedule) on a fake process group and fake tensors, so nothing
is allocated and nothing is sent. The step runs twice: the first creates the optimizer
state, the second is the one whose operations, FLOPs and collective bytes are counted
(``StepTracker``, a ``CollectiveCounter``). The peaks are the most live tensor storage
held at any moment of the three (building the model, the first step, the second): a
run's peak, which a later step repeats.

The planner never runs a real step; what it reports is read from this simulation, and
what ``StepMetrics`` measures in training is read from the allocator (``observe/``):
the two share no code that decides the answer.
"""

from __future__ import annotations

import contextlib
import io
import logging
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from modelparallel.plan.experts import assume_routing, refuse_routing_loops
from modelparallel.plan.fake_world import (
    VALUE_DEPENDENT_SHAPES,
    PlanError,
    fake_process_group,
    fake_tensors,
    user_line,
)
from modelparallel.plan.mailbox import ObjectMailbox
from modelparallel.plan.tracker import StepTracker
from modelparallel.plan.workload import OPTIMIZERS, TrainingScript, Workload
from modelparallel.quiet import quiet_logs


@dataclass
class RankPlan:
    """The simulated step of one rank (bytes are this rank's)."""

    rank: int
    peak_bytes: int  # the most a run can hold (on gloo: its copies freed late)
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    comm_bytes: dict[str, float] = field(default_factory=dict)  # per group label
    comm_calls: dict[str, int] = field(default_factory=dict)
    flops: int = 0
    ops: int = 0  # tensor operations the step runs
    coordinates: dict[str, int] = field(default_factory=dict)  # pp, dp_replicate, ...
    # on gloo, a step whose working copies are freed as soon as their calls return
    peak_bytes_copies_freed_at_once: int = 0
    # tensors alone, without gloo's working copies (on NCCL, all three peaks are this)
    peak_tensor_bytes: int = 0
    # with experts split over expert-parallel ranks, the routing the peaks assume
    # ("worst", plan/experts.py) and the peak with a balanced router; the collectives,
    # FLOPs and operations are then the balanced router's (the expected step)
    routing: str = ""
    peak_bytes_balanced_routing: int = 0
    peak_tensor_bytes_balanced_routing: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def simulate(work: Workload, rank: int, mailbox: ObjectMailbox | None = None,
             routing: str = "worst") -> RankPlan:
    """Simulate ``rank``'s step of ``work`` (in this process; no process group may exist).
    Simulate the ranks of one job in rank order with one ``mailbox``. Experts split over
    expert-parallel ranks receive the rows ``routing`` assumes (``plan/experts.py``)."""
    if work.optimizer not in OPTIMIZERS:
        raise PlanError(f"--optimizer {work.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    import modelparallel as mp
    from modelparallel.observe.collectives import CollectiveCounter

    mailbox = mailbox or ObjectMailbox()
    with _quiet(), fake_process_group(rank, work.world_size), mailbox.delivering(rank):
        mp.init(dict(work.config))
        try:
            with fake_tensors():
                # on CPU, training's collectives go through gloo
                cpu = mp.state.context.device.type == "cpu"
                tracker = StepTracker(gloo=cpu, host=cpu)
                peaks = []  # (tensors, copies freed at once, late) of each phase
                with tracker:
                    trainer = TrainingScript(work, mp)
                refuse_routing_loops(trainer.model)
                routed = assume_routing(trainer.model, routing) > 0
                peaks.append((tracker.peak_tensors, tracker.peak, tracker.peak_late))
                with tracker:  # entering starts the phase's peaks from what is live
                    trainer.step()  # creates the optimizer state
                peaks.append((tracker.peak_tensors, tracker.peak, tracker.peak_late))
                counter = CollectiveCounter(mp.state.group_labels)
                with tracker, counter:
                    trainer.step()
                peaks.append((tracker.peak_tensors, tracker.peak, tracker.peak_late))
                tensors, early, peak = (max(p[i] for p in peaks) for i in range(3))
            held = trainer.held
            return RankPlan(
                rank=rank, peak_bytes=peak, param_bytes=held["param"],
                grad_bytes=held["grad"], optimizer_bytes=held["optimizer"],
                activation_bytes=peak - sum(held.values()),
                comm_bytes=dict(counter.bytes), comm_calls=dict(counter.calls),
                flops=int(tracker.flops), ops=tracker.ops,
                coordinates=dict(mp.state.context.topology.coordinate(rank)),
                peak_bytes_copies_freed_at_once=early, peak_tensor_bytes=tensors,
                routing=routing if routed else "")
        except VALUE_DEPENDENT_SHAPES as error:
            raise PlanError(
                f"the step makes a tensor whose shape depends on values ({error.func}), which "
                f"the planner cannot know without running it, at "
                f"{user_line(traceback.extract_tb(error.__traceback__))}") from None
        finally:
            mp.reset()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The fake backend cannot set timeouts and torch warns about fake collectives:
    neither concerns the plan; what the script would print (the pipeline's partition
    table) is not the plan's either."""
    with quiet_logs("torch", "modelparallel", level=logging.ERROR), \
            contextlib.redirect_stdout(io.StringIO()):
        yield
