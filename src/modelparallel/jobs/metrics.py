"""Metrics of a running job: regexes over its log lines (SageMaker's
``metric_definitions``) and the library's own per-step records (``StepMetrics``)."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

from modelparallel.jobs.follow import FollowedFile

Metric = tuple[str, float, int | None, float]  # name, value, step, timestamp
STEP_FIELDS = ("loss", "samples_per_s", "tokens_per_s", "step_time_s", "peak_memory_bytes")


class LogMetrics:
    """``[{"Name": ..., "Regex": ...}]``: the first group of each match is a value."""

    def __init__(self, definitions: list[dict[str, str]]):
        self.patterns = [(d["Name"], re.compile(d["Regex"])) for d in definitions]

    def parse(self, line: str) -> list[Metric]:
        out: list[Metric] = []
        for name, pattern in self.patterns:
            for match in pattern.finditer(line):
                try:
                    value = float(match.group(1))
                except (TypeError, ValueError):
                    continue
                if math.isfinite(value):
                    out.append((name, value, None, time.time()))
        return out


class StepMetricsFile:
    """Follows the JSON-lines file ``StepMetrics`` appends to (``MP_METRICS_FILE``)."""

    def __init__(self, path: Path):
        self.file = FollowedFile(path)

    def read_new(self) -> list[Metric]:
        out: list[Metric] = []
        for raw in self.file.read_new().splitlines():
            try:
                record = json.loads(raw)
            except json.JSONDecodeError:
                continue
            for key in STEP_FIELDS:
                value = record.get(key)
                if isinstance(value, int | float) and math.isfinite(value):
                    out.append((f"step/{key}", float(value), record.get("step"), time.time()))
        return out
