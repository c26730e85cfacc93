"""PipelineLayout: which layers make each pipeline stage, and which stages each
pipeline rank holds under the configured schedule.

Chosen once, at the first step, from one traced microbatch (:class:`cut.Trace`): layers
placed with ``mp.partition`` / ``mp.set_partition`` (:data:`PARTITION_ATTR`), or by
``default_partition`` when ``auto_partition`` is off, go where they are told; otherwise
the layers are balanced over the stages by their measured compute and memory
(:func:`partition.balance`). Every rank must choose the same layout, so every rank is
given the same trace.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from modelparallel.config import Config
from modelparallel.parallel.pipeline import cut, schedules
from modelparallel.parallel.pipeline import partition as balancing

PARTITION_ATTR = "_mp_partition"  # a module's pipeline stage, set by mp.partition


@dataclass(frozen=True)
class PipelineLayout:
    """The stages of one model over ``ranks`` pipeline ranks."""

    trace: cut.Trace      # the costs the split was chosen from
    split: cut.Split      # the layers and outer modules of each stage
    schedule: str         # the configuration's ``pipeline``
    ranks: int            # pipeline_parallel_degree
    stages_per_rank: int

    @classmethod
    def choose(cls, module: nn.Module, trace: cut.Trace, config: Config,
               ranks: int) -> PipelineLayout:
        """Place the traced layers of ``module`` on ``ranks * stages_per_rank`` stages."""
        stages = ranks * config.stages_per_rank
        placed = [_placement(module, path) for path in trace.layers]
        if any(stage is not None for stage in placed) or not config.auto_partition:
            starts = balancing.manual_starts(placed, stages, config.default_partition,
                                             trace.layers)
            outer = set(trace.shared)
            balancing.check_outer("before", _placed(module, set(trace.before) - outer), 0)
            balancing.check_outer("after", _placed(module, set(trace.after) - outer),
                                  stages - 1)
        else:
            starts = balancing.balance(trace.compute, trace.memory, stages,
                                       memory_weight=config.effective_memory_weight,
                                       before=sum_costs(trace.before),
                                       after=sum_costs(trace.after))
        split = cut.Split(trace.layers, starts, list(trace.before), list(trace.after))
        return cls(trace, split, config.pipeline, ranks, config.stages_per_rank)

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank ``pp_rank`` holds, in order."""
        return schedules.stages_of_rank(self.schedule, pp_rank, self.ranks,
                                        self.stages_per_rank)

    def held_modules(self, pp_rank: int) -> list[str]:
        """Paths of the modules pipeline rank ``pp_rank`` holds."""
        held: list[str] = []
        for stage in self.stage_ids(pp_rank):
            held += [m for m in self.split.modules_of(stage) if m not in held]
        return held

    def all_modules(self) -> list[str]:
        """Paths of every module some stage holds: the layers and the outer modules."""
        split = self.split
        return [*split.layers, *split.before, *[m for m in split.after if m not in split.before]]

    def last_stage_rank(self) -> int:
        """The pipeline rank holding the last stage (where the loss is)."""
        return schedules.rank_of_stage(self.schedule, self.ranks * self.stages_per_rank - 1,
                                       self.ranks, self.stages_per_rank)

    def describe(self) -> str:
        """The stages, their layers and cost shares, as text."""
        t, split = self.trace, self.split
        return balancing.describe(split.starts, split.layers, t.compute, t.memory,
                                  split.before, split.after,
                                  before=sum_costs(t.before), after=sum_costs(t.after))


def sum_costs(costs: dict[str, tuple[float, float]]) -> tuple[float, float]:
    """Total (compute, memory) of modules outside the layers."""
    return (sum(c for c, _ in costs.values()), sum(m for _, m in costs.values()))


def _placement(module: nn.Module, path: str) -> int | None:
    return getattr(module.get_submodule(path), PARTITION_ATTR, None)


def _placed(module: nn.Module, paths: set[str]) -> dict[str, int]:
    """The stages ``mp.partition`` gave to some of ``paths``."""
    return {p: stage for p in paths if (stage := _placement(module, p)) is not None}
