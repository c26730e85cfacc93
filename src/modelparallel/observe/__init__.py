"""Observability: per-step metrics and communication accounting."""

from modelparallel.observe.collectives import CollectiveCounter
from modelparallel.observe.metrics import StepMetrics, StepRecord
from modelparallel.observe.tensor_memory import PeakTensorMemory

__all__ = ["CollectiveCounter", "PeakTensorMemory", "StepMetrics", "StepRecord"]
