"""Pipeline partitioning: which contiguous run of layers each pipeline stage runs.

Pure logic, no processes or collectives: every rank calls these functions with the same
numbers and gets the same answer. A partition is given as ``starts``, the index of the
first layer of each stage (``starts[0] == 0``, strictly increasing). The layers are
whatever the caller cuts between (the pipeline's units, or runs of them between valid
cuts); costs given as ``before`` / ``after`` count towards the first / last stage.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence

import numpy as np

from modelparallel.config import ConfigError

# Bottlenecks this close (relative) count as equal optima: prefix sums round differently.
_TIE = 1e-9


def balance(compute: Sequence[float], memory: Sequence[float], stages: int, *,
            memory_weight: float, before: tuple[float, float] = (0.0, 0.0),
            after: tuple[float, float] = (0.0, 0.0)) -> list[int]:
    """Split layers into ``stages`` contiguous stages, minimising the costliest stage.

    ``compute[i]`` and ``memory[i]`` are the measured costs of layer ``i`` (e.g. forward
    seconds and parameter + activation bytes); ``before`` / ``after`` are the
    ``(compute, memory)`` of the modules that run before the first / after the last
    layer and count towards stage 0 / the last stage. A stage costs
    ``(1 - memory_weight) * compute share + memory_weight * memory share`` (shares of
    the model's totals; see ``Config.effective_memory_weight``). The split is exact;
    among equally good splits it picks the most even in layer counts (least sum of
    squared counts), then the lexicographically smallest ``starts``.

    Returns ``starts``, one per stage. Raises ConfigError when there are fewer layers
    than stages.
    """
    n = len(compute)
    if len(memory) != n:
        raise ValueError(f"compute has {n} layers but memory has {len(memory)}")
    _check_stages(n, stages)
    if not 0.0 <= memory_weight <= 1.0:
        raise ConfigError([("memory_weight", f"{memory_weight} is not in [0, 1]")])
    cost, first, last = _layer_costs(compute, memory, memory_weight, before, after)
    if stages == 1:
        return [0]
    prefix = [0.0, *itertools.accumulate(cost)]
    extra = [0.0] * stages
    extra[0] += first
    extra[-1] += last
    split = _greedy(prefix, extra, _min_bottleneck(prefix, extra))
    assert split is not None  # the bisection only keeps feasible bounds
    limit = max(_stage_costs(prefix, extra, split)) * (1.0 + _TIE)
    return _most_even(prefix, extra, limit)


def manual_starts(assigned: Sequence[int | None], stages: int, default: int,
                  names: Sequence[str]) -> list[int]:
    """The ``starts`` of a partition the user chose layer by layer.

    ``assigned[i]`` is the stage layer ``i`` was put on (SMP v1's ``smp.partition(i)``
    context or ``smp.set_partition``), ``None`` for layers not placed, which go to
    ``default`` (``default_partition``), moved to the nearest stage that keeps the
    stages contiguous: no earlier than the stage of the last placed layer before them,
    no later than that of the first placed layer after them (an unplaced final norm and
    head follow the last block onto the last stage). Stages must be contiguous runs of
    layers in execution order and every stage must get a layer; otherwise ConfigError
    names the offending layers by ``names``.
    """
    n = len(assigned)
    if len(names) != n:
        raise ValueError(f"{n} layers but {len(names)} names")
    _check_stages(n, stages)
    unplaced = any(s is None for s in assigned)
    if unplaced and not 0 <= default < stages:
        raise ConfigError([("default_partition", (
            f"is {default}, but layers not placed explicitly go to it and there are only "
            f"{stages} stages (0..{stages - 1})"))])
    stage = _fill(assigned, default, stages)
    rule = (f"pipeline stages must be contiguous runs of layers in execution order (stage 0 "
            f"first, each stage starting where the previous one ends) and every stage "
            f"0..{stages - 1} must get at least one layer")
    note = f" (layers not placed explicitly go to default_partition={default})" \
        if unplaced else ""
    outside = [f"'{names[i]}' (stage {s})" for i, s in enumerate(stage)
               if not 0 <= s < stages]
    if outside:
        raise ConfigError([("partition", (
            f"{_some(outside)} placed on stages that do not exist: there are {stages} "
            f"stages, 0..{stages - 1}{note}"))])
    issues = [f"'{names[i]}' (stage {stage[i]}) runs after '{names[i - 1]}' "
              f"(stage {stage[i - 1]})" for i in range(1, n) if stage[i] < stage[i - 1]]
    empty = sorted(set(range(stages)) - set(stage))
    if empty:
        issues.append(f"stage{'s' if len(empty) > 1 else ''} "
                      f"{', '.join(map(str, empty))} get{'' if len(empty) > 1 else 's'} "
                      f"no layers")
    if issues:
        raise ConfigError([("partition", (
            f"the layers are not split into {stages} contiguous stages: {_some(issues)}; "
            f"{rule}. Current placement{note}: {_runs(stage, names)}"))])
    return [0, *(i for i in range(1, n) if stage[i] != stage[i - 1])]


def describe(starts: list[int], names: Sequence[str], compute: Sequence[float] | None,
             memory: Sequence[float] | None, before_names: Sequence[str],
             after_names: Sequence[str], *, before: tuple[float, float] = (0.0, 0.0),
             after: tuple[float, float] = (0.0, 0.0)) -> str:
    """A text table of a partition, one row per stage (``model.display_partition()``).

    Columns: stage, its layers by name (with the modules before / after the layers on
    the first / last stage), layer count, and its share of compute and of memory in
    percent (``-`` where the costs are unknown, ``None``). ``before`` / ``after`` are
    the costs of those outer modules, counted like in :func:`balance`.
    """
    n = len(names)
    bounds = [*starts, n]
    rows = [("stage", "layers", "count", "compute", "memory")]
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        parts = []
        if k == 0 and before_names:
            parts.append(", ".join(before_names))
        parts.append(_span(names[a:b]))
        if k == len(starts) - 1 and after_names:
            parts.append(", ".join(after_names))
        rows.append((str(k), " + ".join(parts), str(b - a),
                     _share(compute, 0, a, b, k, len(starts), before, after),
                     _share(memory, 1, a, b, k, len(starts), before, after)))
    widths = [max(len(row[c]) for row in rows) for c in range(5)]
    left = {1}  # names read better left-aligned, numbers right-aligned
    lines = ["  ".join(cell.ljust(w) if c in left else cell.rjust(w)
                       for c, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip()
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


# -- helpers ----------------------------------------------------------------------------

def _check_stages(n: int, stages: int) -> None:
    if stages < 1:
        raise ValueError(f"stages must be >= 1, not {stages}")
    if n < stages:
        raise ConfigError([("pipeline_parallel_degree", (
            f"the model has {n} layers (modules with parameters it can be cut between) and "
            f"cannot be split into {stages} pipeline stages of at least one layer each; use "
            f"pipeline_parallel_degree <= {n}"))])


def _layer_costs(compute: Sequence[float], memory: Sequence[float], weight: float,
                 before: tuple[float, float], after: tuple[float, float],
                 ) -> tuple[list[float], float, float]:
    """Per-layer weighted cost shares, and those of the modules before and after."""
    values = [*compute, *memory, *before, *after]
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise ValueError("layer costs must be finite and >= 0")
    total_c = math.fsum([*compute, before[0], after[0]])
    total_m = math.fsum([*memory, before[1], after[1]])
    # A dimension with nothing measured (zero total) cannot tell stages apart.
    wc = (1.0 - weight) / total_c if total_c > 0 else 0.0
    wm = weight / total_m if total_m > 0 else 0.0
    cost = [wc * c + wm * m for c, m in zip(compute, memory, strict=True)]
    return cost, wc * before[0] + wm * before[1], wc * after[0] + wm * after[1]


def _stage_costs(prefix: list[float], extra: list[float], starts: list[int]) -> list[float]:
    bounds = [*starts, len(prefix) - 1]
    return [prefix[b] - prefix[a] + extra[k]
            for k, (a, b) in enumerate(itertools.pairwise(bounds))]


def _fits(prefix: list[float], extra: list[float], limit: float, k: int, a: int,
          b: int) -> bool:
    """Whether layers a..b-1 as stage k cost <= limit.

    Written as one expression shared with the bisections below, so that every step
    rounds alike and agrees on which stages fit.
    """
    return prefix[b] <= prefix[a] + (limit - extra[k])


def _greedy(prefix: list[float], extra: list[float], limit: float) -> list[int] | None:
    """A split with every stage costing <= limit, if there is one (stages filled greedily).

    Filling each stage as far as possible (while leaving a layer for each later stage)
    ends every stage at least as late as any feasible split does, so only the last stage
    can fail.
    """
    n, stages = len(prefix) - 1, len(extra)
    starts, a = [0], 0
    for k in range(stages - 1):
        if not _fits(prefix, extra, limit, k, a, a + 1):
            return None
        room = n - (stages - 1 - k)  # the latest end that leaves a layer per later stage
        b = bisect.bisect_right(prefix, prefix[a] + (limit - extra[k]), a + 1, room + 1) - 1
        a = max(b, a + 1)
        starts.append(a)
    return starts if _fits(prefix, extra, limit, stages - 1, a, n) else None


def _min_bottleneck(prefix: list[float], extra: list[float]) -> float:
    """The least possible cost of the costliest stage, by bisection on the greedy test."""
    lo, hi = 0.0, 2.0 * (prefix[-1] + sum(extra))  # any split fits under hi
    if _greedy(prefix, extra, lo) is not None:
        return lo
    for _ in range(200):
        if hi - lo <= 1e-13 * hi:
            break
        mid = (lo + hi) / 2
        if _greedy(prefix, extra, mid) is None:
            lo = mid
        else:
            hi = mid
    return hi


def _most_even(prefix: list[float], extra: list[float], limit: float) -> list[int]:
    """Among splits with every stage <= limit: least sum of squared layer counts, then
    lexicographically smallest starts.

    ``best[k][a]`` is the least sum of squared counts of stages k.. when stage k starts
    at layer a (inf when impossible). Sums of squares are integers, exact in float64, so
    ties are exact and the forward walk taking the earliest optimal end yields the
    lexicographically smallest starts.
    """
    n, stages = len(prefix) - 1, len(extra)
    s = np.asarray(prefix)
    best = [np.full(n + 1, np.inf) for _ in range(stages)]
    for last in range(stages - 1, n):
        if _fits(prefix, extra, limit, stages - 1, last, n):
            best[-1][last] = float((n - last) ** 2)
    for k in range(stages - 2, -1, -1):
        cap = n - (stages - 1 - k)  # stage k must end by here
        a = np.arange(k, cap)
        # The furthest end of a stage starting at a (same expression as _fits), so the
        # starts that take a stage of d layers are those whose reach is >= d.
        ends = np.searchsorted(s, s[a] + (limit - extra[k]), side="right") - 1
        reach = np.minimum(ends, cap) - a
        order = np.argsort(-reach, kind="stable")
        a, reach = a[order], reach[order]
        count = np.searchsorted(-reach, -np.arange(cap - k + 1), side="right")
        for d in range(1, cap - k + 1):
            live = a[:count[d]]
            if not live.size:
                break
            best[k][live] = np.minimum(best[k][live], d * d + best[k + 1][live + d])
    if not math.isfinite(best[0][0]):
        raise AssertionError("no split fits the bottleneck found")  # cannot happen
    starts, a0 = [0], 0
    for k in range(stages - 1):
        a0 = next(b for b in range(a0 + 1, n)
                  if _fits(prefix, extra, limit, k, a0, b)
                  and (b - a0) ** 2 + best[k + 1][b] == best[k][a0])
        starts.append(a0)
    return starts


def _share(values: Sequence[float] | None, dim: int, a: int, b: int, k: int, stages: int,
           before: tuple[float, float], after: tuple[float, float]) -> str:
    if values is None:
        return "-"
    total = math.fsum([*values, before[dim], after[dim]])
    if total <= 0:
        return "-"
    part = math.fsum(values[a:b]) + (before[dim] if k == 0 else 0.0) \
        + (after[dim] if k == stages - 1 else 0.0)
    return f"{100.0 * part / total:.1f}%"


def _fill(assigned: Sequence[int | None], default: int, stages: int) -> list[int]:
    """Stages of every layer: the unplaced ones at ``default``, kept between the stages
    of the placed layers around them."""
    placed = [(i, s) for i, s in enumerate(assigned) if s is not None]
    stage = []
    for i, s in enumerate(assigned):
        if s is not None:
            stage.append(s)
            continue
        lo = next((p for j, p in reversed(placed) if j < i), 0)
        hi = next((p for j, p in placed if j > i), stages - 1)
        stage.append(min(max(default, lo), hi))
    return stage


def _span(names: Sequence[str]) -> str:
    """Consecutive layer names, those of one container as a range: ``a, b + blocks.0 ..
    blocks.3 + norm, head``."""
    groups = [list(g) for _, g in itertools.groupby(names, key=lambda n: n.rpartition(".")[0])]
    texts = []
    for g in groups:
        numbered = len(g) > 1 and all(n.rpartition(".")[2].isdigit() for n in g)
        texts.append(f"{g[0]} .. {g[-1]}" if numbered else ", ".join(g))
    return " + ".join(texts)


def _some(items: list[str], most: int = 6) -> str:
    """At most ``most`` items, then how many more: messages stay readable."""
    shown = ", ".join(items[:most])
    return shown if len(items) <= most else f"{shown} and {len(items) - most} more"


def _runs(stage: list[int], names: Sequence[str]) -> str:
    """The placement as runs of consecutive layers on one stage."""
    runs = []
    for s, group in itertools.groupby(range(len(stage)), key=stage.__getitem__):
        idx = list(group)
        span = names[idx[0]] if len(idx) == 1 else f"{names[idx[0]]} .. {names[idx[-1]]}"
        runs.append(f"{span} -> stage {s}")
    return _some(runs, most=8)
