"""``report.html``: one self-contained page about a run, built from its run directory.

The launcher writes it when a run ends (a failed one too, with what there is);
``modelparallel report RUN_DIR`` builds it again. It reads ``config.json`` and
``outcome.json`` (the launcher's), ``layout.json``, ``metrics.jsonl`` and
``schedule.json`` (rank 0's), and links the logs. The figures are inline SVG drawn by
matplotlib (``report_plots``); the page has no script and loads nothing.
"""

from __future__ import annotations

import datetime
import html
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelparallel.observe.run_output import (
    CONFIG_NAME,
    LAYOUT_NAME,
    METRICS_NAME,
    OUTCOME_NAME,
    REPORT_NAME,
    SCHEDULE_NAME,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MiB = 2**20


@dataclass
class RunData:
    """What a run directory holds, read and grouped for the page."""

    path: Path
    config: dict[str, Any] | None = None  # config.json (launcher)
    outcome: dict[str, Any] | None = None  # outcome.json (launcher)
    layout: dict[str, Any] | None = None  # layout.json (rank 0)
    run_id: str | None = None  # the run the metrics below belong to
    attempts: list[tuple[str, list[dict[str, Any]]]] = field(default_factory=list)
    other_runs: int = 0  # earlier runs' lines in a reused directory (not shown)
    schedule: dict[str, Any] | None = None  # the last recorded pipeline schedule
    files: list[tuple[str, int]] = field(default_factory=list)  # (relative path, bytes)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # missing, or cut short by a crash
        return None


def load_run(run_dir: str | os.PathLike) -> RunData:
    """Read a run directory; a file that is missing or unreadable is left out."""
    path = Path(run_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    data = RunData(path, config=_read_json(path / CONFIG_NAME),
                   outcome=_read_json(path / OUTCOME_NAME),
                   layout=_read_json(path / LAYOUT_NAME))
    lines = []
    if (path / METRICS_NAME).is_file():
        for raw in (path / METRICS_NAME).read_text(errors="replace").splitlines():
            try:
                record = json.loads(raw)
            except ValueError:  # a line cut short when a rank was killed
                continue
            if isinstance(record, dict) and "step" in record:
                lines.append(record)
    wanted = (data.outcome or data.config or {}).get("run_id")
    ids = [r.get("run") for r in lines]
    data.run_id = wanted if wanted in ids else (ids[-1] if ids else wanted)
    mine = [r for r in lines if r.get("run") == data.run_id]
    data.other_runs = len({i for i in ids if i != data.run_id})
    by_attempt: dict[int, list[dict[str, Any]]] = {}
    for r in mine:
        by_attempt.setdefault(int(r.get("attempt") or 0), []).append(r)
    several = len(by_attempt) > 1
    data.attempts = [(f"attempt {a}" if several else "", recs)
                     for a, recs in sorted(by_attempt.items())]
    schedules = _read_json(path / SCHEDULE_NAME)
    if isinstance(schedules, list) and schedules:
        data.schedule = schedules[-1]
    data.files = sorted((str(p.relative_to(path)), p.stat().st_size)
                        for p in path.rglob("*") if p.is_file() and p.name != REPORT_NAME)
    return data


def write_report(run_dir: str | os.PathLike) -> Path:
    """Build ``report.html`` in ``run_dir`` from what it holds; its path."""
    data = load_run(run_dir)
    out = data.path / REPORT_NAME
    tmp = out.with_suffix(".partial")
    tmp.write_text(render(data))
    os.replace(tmp, out)
    return out


# -- the page ------------------------------------------------------------------------------
_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1100px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; }
table { border-collapse: collapse; margin: .5em 0; }
td, th { border: 1px solid #ddd; padding: .25em .6em; text-align: left;
         vertical-align: top; font-size: .92em; }
th { background: #f5f5f5; }
.ok { color: #1a7f37; } .failed { color: #c62828; } .note { color: #666; }
.plots { display: grid; grid-template-columns: 1fr 1fr; gap: .5em 1.5em; }
figure.plot { margin: .5em 0; } figure.plot svg { width: 100%; height: auto; }
figure.wide { grid-column: 1 / -1; }
pre { background: #f7f7f7; padding: .7em; overflow-x: auto; font-size: .85em; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _time(t: Any) -> str:
    if not isinstance(t, int | float):
        return "-"
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _table(rows: list[tuple[str, Any]], klass: str = "") -> str:
    body = "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="{klass}">{body}</table>'


def _status(data: RunData) -> str:
    o = data.outcome
    if o is None:
        return '<span class="note">no outcome recorded (still running, or the launcher ' \
               "was killed)</span>"
    code = o.get("exit_code")
    if code == 0:
        return '<span class="ok">completed (exit code 0)</span>'
    what = f"exit code {code}" if code is not None else "interrupted"
    return f'<span class="failed">failed ({_e(what)})</span>'


def _header(data: RunData) -> str:
    launch = (data.config or {}).get("launch", {})
    o = data.outcome or {}
    started = o.get("started_at") or (data.config or {}).get("started_at")
    ended = o.get("ended_at")
    duration = (f"{ended - started:.1f} s" if isinstance(ended, int | float)
                and isinstance(started, int | float) else "-")
    script = " ".join([launch.get("script", "?"), *launch.get("script_args", [])])
    rows = [("status", _status(data)), ("script", f"<code>{_e(script)}</code>"),
            ("started", _e(_time(started))), ("duration", _e(duration)),
            ("run directory", f"<code>{_e(data.path.resolve())}</code>")]
    head = (f"<h1>Run {_e(data.run_id or data.path.name)}</h1>"
            f'<section id="outcome">{_table(rows)}')
    if o.get("summary"):
        head += f"<pre>{_e(o['summary'])}</pre>"
    return head + "</section>"


def _configuration(data: RunData) -> str:
    parts = ['<section id="configuration"><h2>Configuration and topology</h2>']
    launch = (data.config or {}).get("launch")
    if launch:
        rows = [(k, _e(json.dumps(v))) for k, v in launch.items() if v not in (None, [])]
        versions = (data.config or {}).get("versions", {})
        rows += [(f"{k} version", _e(v)) for k, v in versions.items()]
        parts.append("<h3>Launch</h3>" + _table(rows))
    layout = data.layout
    if layout:
        topo = layout.get("topology", {})
        rows = [("layout", _e(topo.get("describe", "-"))), ("device", _e(layout.get("device")))]
        rows += [(f"{d} degree", _e(n)) for d, n in topo.get("dims", {}).items()]
        parts.append("<h3>Topology (as the script ran)</h3>" + _table(rows))
        config, source = layout.get("config", {}), "the script's mp.init with --config / MP_CONFIG"
        explicit = layout.get("explicit", [])
    else:
        config = (data.config or {}).get("config", {})
        explicit = sorted((data.config or {}).get("config_explicit", {}))
        source = "the launcher's --config / MP_CONFIG (the script's own values are not known: " \
                 "no step metrics were recorded)"
    if config:
        set_rows = [(k, _e(json.dumps(config.get(k)))) for k in explicit if k in config]
        parts.append(f'<h3>Configuration</h3><p class="note">from {_e(source)}; keys set '
                     f"explicitly:</p>" + (_table(set_rows) if set_rows else
                                           "<p>none (all defaults)</p>"))
        all_rows = [(k, _e(json.dumps(v))) for k, v in sorted(config.items())]
        parts.append(f"<details><summary>all {len(all_rows)} keys</summary>"
                     f"{_table(all_rows)}</details>")
    return "".join(parts) + "</section>"


def _figure(fig_id: str, fig: Figure | None, caption: str, wide: bool = False) -> str:
    if fig is None:
        return ""
    from modelparallel.observe.report_plots import svg

    return (f'<figure class="plot{" wide" if wide else ""}" id="plot-{fig_id}">{svg(fig, fig_id)}'
            f"<figcaption class=\"note\">{_e(caption)}</figcaption></figure>")


def _summary_rows(records: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    from modelparallel.observe.report_plots import memory_measured, percentiles

    rows: list[tuple[str, Any]] = [("steps", len(records))]
    losses = [r["loss"] for r in records if isinstance(r.get("loss"), int | float)]
    if losses:
        rows.append(("loss", f"{losses[0]:.4f} &rarr; {losses[-1]:.4f}"))
    times = [r["step_time_s"] * 1e3 for r in records[1:]] or \
            [r["step_time_s"] * 1e3 for r in records]
    p50, p90 = percentiles(times)
    first = records[0]["step_time_s"] * 1e3
    rows.append(("step time", f"first {first:.1f} ms (warm-up); then median {p50:.1f} ms, "
                              f"p90 {p90:.1f} ms, max {max(times):.1f} ms"))
    for key, unit in (("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s")):
        values = [r[key] for r in records[1:] if isinstance(r.get(key), int | float)]
        if values:
            rows.append((unit, f"median {percentiles(values, (0.5,))[0]:,.1f}"))
    measured = [r for r in records if memory_measured(r)]
    if measured:
        peak = max(measured, key=lambda r: r["peak_memory_bytes"])
        rows.append(("peak memory (rank 0)",
                     f"{peak['peak_memory_bytes'] / MiB:,.0f} MiB "
                     f"({_e(peak.get('memory_kind', 'rss'))}; measured in {len(measured)} of "
                     f"{len(records)} steps)"))
    else:
        rows.append(("peak memory (rank 0)", "not measured"))
    last = records[-1]
    for group, nbytes in sorted(last.get("comm_bytes", {}).items()):
        calls = last.get("comm_calls", {}).get(group, 0)
        rows.append((f"comm {group}", f"{nbytes / MiB:,.2f} MiB in {calls} calls (last step)"))
    return rows


def _training(data: RunData) -> str:
    parts = ['<section id="training"><h2>Training</h2>']
    records = [r for _, recs in data.attempts for r in recs]
    if not records:
        parts.append('<p class="note">No step metrics: the script did not use '
                     "<code>mp.observe.StepMetrics</code>, or no step finished.</p>")
        return "".join(parts) + "</section>"
    from modelparallel.observe import report_plots as plots

    if data.other_runs:
        parts.append(f'<p class="note">metrics.jsonl also holds {data.other_runs} earlier '
                     "run(s) of this directory; only this run is shown.</p>")
    parts.append(_table(_summary_rows(records)))
    series = data.attempts
    parts.append('<div class="plots">')
    parts.append(_figure("loss", plots.loss_figure(series), "loss per step, averaged over "
                                                          "the data-parallel ranks"))
    parts.append(_figure("throughput", plots.throughput_figure(series),
                         "samples (and tokens) per second of the whole job"))
    parts.append(_figure("step_time", plots.step_time_figure(series),
                         "step time: wall time of each step on rank 0; the first includes "
                         "the warm-up", wide=True))
    parts.append(_figure("memory", plots.memory_figure(series),
                         "rank 0's peak memory, at the steps where it was measured (on CPU "
                         "StepMetrics measures the first memory_steps steps; the others stay "
                         "empty)"))
    parts.append(_figure("comm", plots.comm_figure(series),
                         "bytes rank 0 moved in collectives per process group "
                         "(ring-model bus bytes, docs/metrics.md)"))
    return "".join(parts) + "</div></section>"


def _pipeline(data: RunData) -> str:
    s = data.schedule
    if not s:
        return ""
    from modelparallel.observe import report_plots as plots

    rows = [("stages x microbatches", f"{_e(s.get('ranks'))} x {_e(s.get('microbatches'))}"
                                      f" (virtual {_e(s.get('virtual', 1))})"),
            ("bubble", f"{s.get('bubble', 0):.1%} measured, {s.get('theoretical', 0):.1%} "
                       "ideal")]
    return ('<section id="pipeline"><h2>Pipeline schedule</h2>'
            '<p class="note">the last step recorded with <code>model.record_schedule()'
            "</code></p>" + _table(rows)
            + _figure("schedule", plots.schedule_figure(s),
                      "each forward (F), backward (B) and weight-gradient backward (W) of "
                      "each microbatch, by pipeline rank")
            + _figure("busy", plots.busy_figure(s), "where each rank's time went in that step")
            + "</section>")


def _files(data: RunData) -> str:
    rows = [(name, f'<a href="{_e(name)}">{size:,} bytes</a>') for name, size in data.files]
    log_dir = ((data.config or {}).get("launch") or {}).get("log_dir")
    note = (f'<p class="note">the ranks\' logs are in {_e(log_dir)}</p>' if log_dir else "")
    return (f'<section id="files"><h2>Files</h2>{note}'
            f"<details><summary>{len(rows)} files</summary>{_table(rows)}</details></section>")


def render(data: RunData) -> str:
    """The page, as one HTML string."""
    title = _e(data.run_id or data.path.name)
    body = (_header(data) + _configuration(data) + _training(data) + _pipeline(data)
            + _files(data))
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f"<title>modelparallel run {title}</title><style>{_STYLE}</style></head>"
            f"<body>{body}<p class=\"note\">written by modelparallel at "
            f"{_e(_time(datetime.datetime.now().timestamp()))}</p></body></html>")
