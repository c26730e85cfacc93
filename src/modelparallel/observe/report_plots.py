"""The report's figures, drawn with matplotlib and embedded as inline SVG (no script, no
network: the page is one file).

Each ``*_figure`` function takes what ``report.load_run`` read and returns one
matplotlib figure (None when there is nothing to draw); ``svg`` makes it markup. Only
measured points are drawn: a step without a value leaves a gap. ``Figure`` objects are
made directly (not through pyplot), so nothing global changes and no window system is
asked for.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import matplotlib as mpl
from matplotlib.figure import Figure
from matplotlib.patches import Patch

MiB = 2**20
KIND_COLOURS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b"}
KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight-gradient backward"}

Series = list[tuple[str, list[dict[str, Any]]]]  # (label, records) per restart attempt
Line = tuple[str, list[float], list[float]]  # (label, steps, values); NaN breaks the line
DASHES = ("-", "--", ":", "-.")  # one per restart attempt


def svg(fig: Figure, name: str) -> str:
    """The figure as an ``<svg>`` element; ids are salted with ``name`` so figures on
    one page never share one."""
    buf = io.StringIO()
    with mpl.rc_context({"svg.fonttype": "none", "svg.hashsalt": name}):
        fig.savefig(buf, format="svg")  # the constrained layout fits it: one draw, not two
    text = buf.getvalue()
    svg = text[text.index("<svg"):]
    # scale with the page: keep the viewBox, drop the fixed size
    return re.sub(r'<svg([^>]*?) width="[^"]*" height="[^"]*"', r"<svg\1", svg, count=1)


def _figure(width: float = 5.2, height: float = 2.8) -> Figure:
    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def memory_measured(record: dict[str, Any]) -> bool:
    """Whether the step's memory was measured: StepMetrics measures CPU memory in the
    first ``memory_steps`` steps only and gives the later ones the largest measured peak
    ("tensors, max of steps 1-3"), or "none"."""
    kind = str(record.get("memory_kind", "rss"))
    return "," not in kind and kind != "none" and _number(record.get("peak_memory_bytes"))


def _lines(series: Series, key: str, scale: float = 1.0,
           measured: Callable[[dict[str, Any]], bool] = lambda r: True) -> list[Line]:
    """(label, steps, values) per attempt, of the steps whose ``key`` was measured; where
    steps between two measured ones were not, a NaN breaks the line (a gap, not a line
    drawn over steps nobody measured)."""
    out = []
    for label, records in series:
        xs: list[float] = []
        ys: list[float] = []
        for r in records:
            if not (_number(r.get(key)) and measured(r)):
                continue
            if xs and r["step"] != xs[-1] + 1:
                xs.append(math.nan)
                ys.append(math.nan)
            xs.append(r["step"])
            ys.append(r[key] * scale)
        if xs:
            out.append((label, xs, ys))
    return out


def _plot(ax: Any, xs: list[float], ys: list[float], **style: Any) -> None:
    """One line; markers where the points are few or a gap may leave one alone."""
    sparse = len(xs) < 40 or any(math.isnan(x) for x in xs)
    ax.plot(xs, ys, marker="." if sparse else None, **style)


def _plot_lines(ax: Any, lines: list[Line], ylabel: str) -> None:
    for label, xs, ys in lines:
        _plot(ax, xs, ys, label=label or None)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if any(label for label, _, _ in lines):
        ax.legend(fontsize="small")


def loss_figure(series: Series) -> Figure | None:
    lines = _lines(series, "loss")
    if not lines:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    _plot_lines(ax, lines, "loss (mean over data-parallel ranks)")
    ax.set_title("Loss")
    return fig


def throughput_figure(series: Series) -> Figure | None:
    samples = _lines(series, "samples_per_s")
    if not samples:
        return None
    tokens = _lines(series, "tokens_per_s")
    fig = _figure()
    ax = fig.add_subplot()
    _plot_lines(ax, samples, "samples/s")
    ax.set_title("Throughput" + (" (tokens/s dashed, right)" if tokens else ""))
    if tokens:
        right = ax.twinx()
        for _, xs, ys in tokens:
            right.plot(xs, ys, color="#888888", linewidth=0.8, linestyle="--")
        right.set_ylabel("tokens/s")
    return fig


def step_time_figure(series: Series) -> Figure | None:
    """Step time per step, and how the step times spread (the first step, which includes
    the warm-up, apart)."""
    lines = _lines(series, "step_time_s", 1e3)
    if not lines:
        return None
    fig = _figure(10.0, 2.8)
    left, right = fig.subplots(1, 2, width_ratios=[2, 1])
    _plot_lines(left, lines, "ms")
    left.set_yscale("log")
    left.set_title("Step time")
    per_attempt = [[y for y in ys if not math.isnan(y)] for _, _, ys in lines]
    times = [y for ys in per_attempt for y in ys[1:]] or [y for ys in per_attempt for y in ys]
    right.hist(times, bins=min(30, max(5, len(times) // 3)), color="#4c78a8")
    right.set_xlabel("ms (steps after the first)")
    right.set_ylabel("steps")
    right.set_title("Spread")
    return fig


def memory_figure(series: Series) -> Figure | None:
    """Rank 0's peak memory at the steps where it was measured; the x axis spans every
    step, so the unmeasured ones show as empty."""
    lines = _lines(series, "peak_memory_bytes", 1 / MiB, measured=memory_measured)
    if not lines:
        return None
    kinds = {r["memory_kind"] for _, records in series for r in records
             if memory_measured(r) and "memory_kind" in r} or {"rss"}
    what = ("CUDA max allocated" if kinds == {"cuda"} else
            "process peak RSS" if kinds == {"rss"} else
            "peak tensor bytes" if kinds == {"tensors"} else "peak")
    fig = _figure()
    ax = fig.add_subplot()
    _plot_lines(ax, lines, f"MiB ({what})")
    steps = [r["step"] for _, records in series for r in records]
    ax.set_xlim(min(steps) - 0.5, max(steps) + 0.5)
    ax.set_title("Memory of rank 0")
    return fig


def comm_figure(series: Series) -> Figure | None:
    """Bytes each process group moved per step (rank 0's view, ring-model bytes); the
    legend gives each group's total."""
    groups = sorted({g for _, records in series for r in records for g in r.get("comm_bytes", {})})
    if not groups:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    for colour, group in enumerate(groups):
        # a step that counted collectives and has no bytes for the group moved none
        counted = [(label, [{"step": r["step"], "mib": r["comm_bytes"].get(group, 0.0) / MiB}
                            for r in records if isinstance(r.get("comm_bytes"), dict)])
                   for label, records in series]
        for n, (label, xs, ys) in enumerate(_lines(counted, "mib")):
            total = sum(y for y in ys if not math.isnan(y))
            name = f"{group}{f', {label}' if label else ''} ({total:,.2f} MiB in all)"
            _plot(ax, xs, ys, label=name, color=f"C{colour}", linestyle=DASHES[n % len(DASHES)])
    ax.set_xlabel("step")
    ax.set_ylabel("MiB per step")
    ax.set_title("Communication per group")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def schedule_figure(schedule: dict[str, Any]) -> Figure | None:
    """One row per pipeline rank: each forward (F), backward (B) and weight-gradient
    backward (W) as a bar over its time, labelled with its microbatch."""
    events = schedule.get("events") or []
    if not events:
        return None
    ranks = sorted({e["rank"] for e in events})
    span = max(e["end"] for e in events) * 1e3
    fig = _figure(10.0, 1.1 + 0.55 * len(ranks))
    ax = fig.add_subplot()
    for row, rank in enumerate(ranks):
        for kind, colour in KIND_COLOURS.items():
            bars = [(e["start"] * 1e3, (e["end"] - e["start"]) * 1e3) for e in events
                    if e["rank"] == rank and e["kind"] == kind]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colour, edgecolor="white",
                               linewidth=0.5)
        for e in events:
            width = (e["end"] - e["start"]) * 1e3
            if e["rank"] == rank and width > span / 60:  # label the bars wide enough
                ax.text(e["start"] * 1e3 + width / 2, row, str(e["microbatch"]), ha="center",
                        va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first event")
    ax.set_title(f"Pipeline schedule: {schedule.get('ranks')} stages x "
                 f"{schedule.get('microbatches')} microbatches (numbers: microbatch)")
    kinds = sorted({e["kind"] for e in events}, key="FBW".index)
    handles = [Patch(color=KIND_COLOURS[k], label=KIND_NAMES[k]) for k in kinds]
    fig.legend(handles=handles, fontsize="small", ncols=3, loc="outside lower center")
    return fig


def busy_figure(schedule: dict[str, Any]) -> Figure | None:
    """Where each pipeline rank's time went in the recorded span: forward, backward,
    weight-gradient backward, idle (the bubble)."""
    events = schedule.get("events") or []
    if not events:
        return None
    ranks = sorted({e["rank"] for e in events})
    span = max(e["end"] for e in events) - min(e["start"] for e in events)
    if span <= 0:
        return None
    fig = _figure(10.0, 1.0 + 0.4 * len(ranks))
    ax = fig.add_subplot()
    left = [0.0] * len(ranks)
    for kind in "FBW":
        shares = [sum(e["end"] - e["start"] for e in events
                      if e["rank"] == r and e["kind"] == kind) / span for r in ranks]
        if any(shares):
            ax.barh(range(len(ranks)), shares, left=left, color=KIND_COLOURS[kind],
                    label=KIND_NAMES[kind])
            left = [a + b for a, b in zip(left, shares, strict=True)]
    ax.barh(range(len(ranks)), [max(0.0, 1 - x) for x in left], left=left, color="#dddddd",
            label="idle")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of the recorded span")
    ax.set_title("Step time by pipeline rank")
    fig.legend(fontsize="small", ncols=4, loc="outside lower center")
    return fig


def percentiles(values: Sequence[float], qs: Sequence[float] = (0.5, 0.9)) -> list[float]:
    """Nearest-rank percentiles of ``values`` (which must not be empty)."""
    ordered = sorted(values)
    return [ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in qs]
