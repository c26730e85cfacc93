"""PipelineLayout: which units make each pipeline stage, and which stages each
pipeline rank holds under the configured schedule.

Chosen once, at the first step, from one traced microbatch (:class:`trace.Trace`):
units placed with ``mp.partition`` / ``mp.set_partition`` (``ModuleState.partition``, on
the unit or a module around it), or by ``default_partition`` when ``auto_partition`` is
off, go where they are told; otherwise the runs of units between valid cuts are balanced
over the stages by their measured compute and memory (:func:`partition.balance`). Every
rank must choose the same layout, so every rank is given the same trace.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from torch import nn

from modelparallel.config import Config, ConfigError
from modelparallel.module_state import lookup
from modelparallel.parallel.pipeline import cut, schedules
from modelparallel.parallel.pipeline import partition as balancing
from modelparallel.parallel.pipeline.absent import Holder
from modelparallel.parallel.pipeline.trace import Trace


@dataclass(frozen=True)
class PipelineLayout:
    """The stages of one model over ``ranks`` pipeline ranks."""

    trace: Trace          # the costs the split was chosen from
    split: cut.Split      # the units of each stage
    schedule: str         # the configuration's ``pipeline``
    ranks: int            # pipeline_parallel_degree
    stages_per_rank: int

    @classmethod
    def choose(cls, module: nn.Module, trace: Trace, config: Config,
               ranks: int) -> PipelineLayout:
        """Place the traced units of ``module`` on ``ranks * stages_per_rank`` stages."""
        stages = ranks * config.stages_per_rank
        placed = [_placement(module, path) for path in trace.layers]
        if any(stage is not None for stage in placed) or not config.auto_partition:
            starts = balancing.manual_starts(placed, stages, config.default_partition,
                                             trace.layers)
            _check_cuts(trace, starts)
        else:
            starts = _balanced(trace, stages, config.effective_memory_weight)
        split = cut.Split(trace.layers, starts, trace.crossing, trace.unused)
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

    def holder(self, path: str) -> Holder:
        """The first stage holding the unit at ``path`` and the pipeline rank running it."""
        stage = next(s for s in range(self.split.stages) if path in self.split.modules_of(s))
        return Holder(stage, schedules.rank_of_stage(self.schedule, stage, self.ranks,
                                                     self.stages_per_rank))

    def all_modules(self) -> list[str]:
        """Paths of every module some stage holds: the units."""
        return [*self.split.layers, *self.split.unused]

    def last_stage_rank(self) -> int:
        """The pipeline rank holding the last stage (where the loss is)."""
        return schedules.rank_of_stage(self.schedule, self.ranks * self.stages_per_rank - 1,
                                       self.ranks, self.stages_per_rank)

    def describe(self) -> str:
        """The stages, their units and cost shares, as text."""
        t, split = self.trace, self.split
        return balancing.describe(split.starts, split.layers, t.compute, t.memory, [], [])


def _balanced(trace: Trace, stages: int, memory_weight: float) -> list[int]:
    """Starts of the most balanced split that cuts only where the trace allows."""
    cuts = [c for c, ok in enumerate(trace.valid) if ok]  # cuts[0] == 0
    if len(cuts) < stages:
        blocked = "; ".join(f"not before '{trace.layers[c]}': {why}"
                            for c, why in sorted(trace.why_not.items())[:4])
        raise ConfigError([("pipeline_parallel_degree", (
            f"the model can be cut into at most {len(cuts)} pipeline stages (it has "
            f"{len(trace.layers)} modules with parameters, {', '.join(trace.layers[:8])}"
            f"{' ...' if len(trace.layers) > 8 else ''}, and a stage may start only where "
            f"nothing computed before it is needed after it except its first module's "
            f"arguments{': ' + blocked if blocked else ''}); use pipeline_parallel_degree "
            f"x virtual stages <= {len(cuts)}"))])
    bounds = [*cuts, len(trace.layers)]
    runs = list(itertools.pairwise(bounds))
    compute = [sum(trace.compute[a:b]) for a, b in runs]
    memory = [sum(trace.memory[a:b]) for a, b in runs]
    chosen = balancing.balance(compute, memory, stages, memory_weight=memory_weight)
    return [cuts[i] for i in chosen]


def _check_cuts(trace: Trace, starts: list[int]) -> None:
    """A placement may start a stage only where the trace says a cut is valid."""
    bad = [(k, c) for k, c in enumerate(starts) if not trace.valid[c]]
    if bad:
        raise ConfigError([("partition", (
            f"stage {k} cannot start at '{trace.layers[c]}': {trace.why_not.get(c, '')}. A "
            f"stage receives only the arguments of its first module; place the modules so "
            f"that the value stays within one stage")) for k, c in bad])


def _placement(module: nn.Module, path: str) -> int | None:
    """The stage ``mp.partition`` / ``mp.set_partition`` gave the unit at ``path`` or
    the innermost module around it that has one."""
    parts = path.split(".")
    for k in range(len(parts), -1, -1):
        stage = lookup(module.get_submodule(".".join(parts[:k])), "partition")
        if stage is not None:
            return stage
    return None
