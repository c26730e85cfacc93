"""Observability: per-step metrics and communication accounting."""

from modelparallel.observe.collectives import CollectiveCounter
from modelparallel.observe.metrics import StepMetrics, StepRecord

__all__ = ["CollectiveCounter", "StepMetrics", "StepRecord"]
