"""Metrics of a running job: regexes over its log lines (SageMaker's
``metric_definitions``) and the library's own per-step records (``StepMetrics``)."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

Metric = tuple[str, float, int | None, float]  # name, value, step, timestamp
STEP_FIELDS = ("loss", "samples_per_s", "tokens_per_s", "step_time_s", "peak_memory_bytes")


class LogMetrics:
    """``[{"Name": ..., "Regex": ...}]``: the first group of each match is a value."""

    def __init__(self, definitions: list[dict[str, str]]):
        self.patterns = [(d["Name"], re.compile(d["Regex"])) for d in definitions]

    def parse(self, line: str) -> list[Metric]:
        out = []
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
        self.path = path
        self.offset = 0

    def read_new(self) -> list[Metric]:
        if not self.path.is_file():
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for next time
        self.offset += end
        out = []
        for raw in data[:end].splitlines():
            try:
                record = json.loads(raw)
            except json.JSONDecodeError:
                continue
            for key in STEP_FIELDS:
                value = record.get(key)
                if isinstance(value, int | float) and math.isfinite(value):
                    out.append((f"step/{key}", float(value), record.get("step"), time.time()))
        return out
