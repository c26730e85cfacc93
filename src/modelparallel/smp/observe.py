"""``mp.observe``: per-step metrics of the current ``mp.init()``'s layout, and
communication accounting (implemented in ``modelparallel.observe``)."""

from __future__ import annotations

from modelparallel.context import ParallelContext
from modelparallel.observe import metrics
from modelparallel.observe.collectives import CollectiveCounter
from modelparallel.observe.metrics import StepRecord
from modelparallel.observe.tensor_memory import PeakTensorMemory
from modelparallel.smp.state import state


class StepMetrics(metrics.StepMetrics):
    __doc__ = metrics.StepMetrics.__doc__

    def _context(self) -> ParallelContext:
        if self.context is not None:
            return self.context
        return state.require("mp.observe.StepMetrics").context


__all__ = ["CollectiveCounter", "PeakTensorMemory", "StepMetrics", "StepRecord"]
