"""report.html from a run directory's files, ``modelparallel report``, and the progress
bar's two forms (a terminal, and plain lines anywhere else)."""

from __future__ import annotations

import io
import json
import os
import re
import select
import time

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from modelparallel.launch.cli import main as cli_main
from modelparallel.launch.run_dir import new_run_dir
from modelparallel.observe import report_plots
from modelparallel.observe.progress import Progress
from modelparallel.observe.report import load_run, write_report


def record(run: str, step: int, attempt: int = 0, loss: float = 1.0) -> dict:
    return {"run": run, "attempt": attempt, "time": time.time(), "step": step, "samples": 8,
            "tokens": 64, "loss": loss, "step_time_s": 0.01 * step, "samples_per_s": 800.0,
            "tokens_per_s": 6400.0, "peak_memory_bytes": 2**20 * 300, "memory_kind": "rss",
            "comm_bytes": {"dp_shard": 4096.0, "pp": 512.0}, "comm_calls": {"dp_shard": 4}}


def write_lines(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def figures(page: str) -> dict[str, str]:
    """figure id -> its <svg> markup."""
    return dict(re.findall(r'<figure class="plot[^"]*" id="plot-([a-z_]+)">(<svg.*?</svg>)',
                           page, re.DOTALL))


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "2026-11-26_171503-train"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "run_id": d.name, "started_at": time.time() - 5,
        "launch": {"script": "train.py", "script_args": ["--steps", "4"], "nproc_per_node": 2,
                   "nnodes": 1, "world_size": 2},
        "config_explicit": {"pipeline_parallel_degree": 2},
        "config": {"pipeline_parallel_degree": 2, "microbatches": 4}}))
    return d


def test_the_report_shows_this_run_its_plots_and_the_schedule(run_dir):
    earlier = [record("an-earlier-run", s, loss=9.0) for s in (1, 2)]
    write_lines(run_dir / "metrics.jsonl",
                earlier + [record(run_dir.name, s, loss=2.0 / s) for s in (1, 2, 3, 4)])
    (run_dir / "metrics.jsonl").open("a").write('{"run": "cut short by a kil')
    events = [{"rank": r, "stage": r, "kind": k, "microbatch": m, "start": t, "end": t + 0.01}
              for r in (0, 1) for m in range(2) for k, t in (("F", 0.02 * m + 0.01 * r),
                                                              ("B", 0.1 + 0.02 * m))]
    (run_dir / "schedule.json").write_text(json.dumps([{
        "ranks": 2, "microbatches": 2, "virtual": 1, "bubble": 0.4, "theoretical": 1 / 3,
        "events": events}]))
    (run_dir / "outcome.json").write_text(json.dumps({"run_id": run_dir.name, "exit_code": 0,
                                                       "started_at": 1.0, "ended_at": 3.5}))
    page = write_report(run_dir).read_text()
    assert set(figures(page)) == {"loss", "throughput", "step_time", "memory", "comm",
                                  "schedule", "busy"}
    for name, svg in figures(page).items():
        assert svg.count("<path") >= 3, f"{name} draws nothing"
    assert "completed (exit code 0)" in page and "2.5 s" in page
    assert "2.0000 &rarr; 0.5000" in page, "this run's loss, not the earlier run's 9.0"
    assert "1 earlier run(s)" in page
    assert "40.0% measured, 33.3% ideal" in page
    assert "<script" not in page, "no script"
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page), "nothing from a network"
    assert "train.py --steps 4" in page


def cpu_run(run: str, steps: int, measured: int) -> list[dict]:
    """What StepMetrics writes on CPU: memory measured in the first ``measured`` steps,
    the later ones carry the largest measured peak."""
    out = []
    for step in range(1, steps + 1):
        r = record(run, step, loss=3.0 / step)
        if step <= measured:
            r.update(peak_memory_bytes=2**20 * (100 + step), memory_kind="tensors")
        else:
            r.update(peak_memory_bytes=2**20 * (100 + measured),
                     memory_kind=f"tensors, max of steps 1-{measured}")
        out.append(r)
    return out


def drawn_steps(fig) -> list[list[float]]:
    """Each line's steps as drawn, a NaN where the line breaks."""
    return [[x if x == x else "gap" for x in line.get_xdata()] for line in fig.axes[0].lines]


def test_the_memory_plot_draws_only_the_measured_steps(run_dir):
    write_lines(run_dir / "metrics.jsonl", cpu_run(run_dir.name, steps=8, measured=3))
    series = load_run(run_dir).attempts
    assert drawn_steps(report_plots.memory_figure(series)) == [[1, 2, 3]]
    page = write_report(run_dir).read_text()
    markers = re.findall(r'<g clip-path="url\(#\w+\)">(.*?)</g>', figures(page)["memory"],
                         re.DOTALL)
    assert "".join(markers).count("<use ") == 3, "one marker per measured step, none on 4-8"
    assert "101 MiB" not in page and "103 MiB (tensors; measured in 3 of 8 steps)" in page


def test_a_step_without_a_value_leaves_a_gap_in_the_line(run_dir):
    records = cpu_run(run_dir.name, steps=8, measured=8)
    del records[4]["loss"]  # step 5 recorded no loss
    del records[6]  # step 7's line was lost
    write_lines(run_dir / "metrics.jsonl", records)
    series = load_run(run_dir).attempts
    assert drawn_steps(report_plots.loss_figure(series)) == [[1, 2, 3, 4, "gap", 6, "gap", 8]]
    assert drawn_steps(report_plots.memory_figure(series)) == [[1, 2, 3, 4, 5, 6, "gap", 8]]
    assert drawn_steps(report_plots.comm_figure(series))[0] == [1, 2, 3, 4, 5, 6, "gap", 8]


def busy_schedule(ranks: int, microbatches: int) -> dict:
    events = [{"rank": r, "stage": r, "kind": k, "microbatch": m, "start": t, "end": t + 0.01}
              for r in range(ranks) for m in range(microbatches)
              for k, t in (("F", 0.02 * m + 0.01 * r), ("B", 0.5 + 0.02 * m), ("W", 0.9 + m))]
    return {"ranks": ranks, "microbatches": microbatches, "virtual": 2, "bubble": 0.4,
            "theoretical": 0.3, "events": events}


def test_every_figure_keeps_its_texts_inside_it():
    """Titles, labels, ticks and legends measured as matplotlib draws them: none is cut
    off at the figure's edge (the SVG's viewBox, which the page scales)."""
    records = [dict(r, comm_bytes={"dp_shard": 2.0**30, "pp": 512.0, "tp": 4096.0},
                    tokens_per_s=6.4e6) for r in cpu_run("r", steps=120, measured=3)]
    series = [("attempt 0", records), ("attempt 1", records[:40])]
    made = {name: getattr(report_plots, f"{name}_figure")(series)
            for name in ("loss", "throughput", "step_time", "memory", "comm")}
    made |= {name: getattr(report_plots, f"{name}_figure")(busy_schedule(4, 8))
             for name in ("schedule", "busy")}
    made |= {f"memory ({kind})": report_plots.memory_figure(
        [("", [dict(r, memory_kind=kind) for r in records])]) for kind in ("cuda", "rss")}
    for name, fig in made.items():
        renderer = FigureCanvasAgg(fig).get_renderer()
        fig.draw(renderer)
        inside = fig.bbox.padded(0.5)
        titles = [a.title for a in fig.axes if a.title.get_text()]
        assert titles, f"{name} has no title"
        for title in titles:
            ext = title.get_window_extent(renderer)
            assert inside.x0 <= ext.x0 and ext.x1 <= inside.x1 and ext.y1 <= inside.y1, \
                f"{name}: title {title.get_text()!r} spans x {ext.x0:.0f}-{ext.x1:.0f}, " \
                f"y to {ext.y1:.0f} of a {fig.bbox.width:.0f}x{fig.bbox.height:.0f} figure"
        drawn = fig.get_tightbbox(renderer).transformed(fig.dpi_scale_trans)
        assert (inside.x0 <= drawn.x0 and drawn.x1 <= inside.x1 and inside.y0 <= drawn.y0
                and drawn.y1 <= inside.y1), f"{name}: labels or legend outside: {drawn}"


def test_restart_attempts_are_separate_series(run_dir):
    write_lines(run_dir / "metrics.jsonl", [record(run_dir.name, s, attempt=a)
                                            for a in (0, 1) for s in (1, 2)])
    data = load_run(run_dir)
    assert [label for label, _ in data.attempts] == ["attempt 0", "attempt 1"]
    assert "attempt 1" in figures(write_report(run_dir).read_text())["loss"]


def test_a_failed_run_without_metrics_still_gets_a_report(run_dir, capsys):
    (run_dir / "outcome.json").write_text(json.dumps({
        "run_id": run_dir.name, "exit_code": 1, "summary": "rank 1 failed first: <boom>"}))
    with pytest.raises(SystemExit) as exit_:
        cli_main(["report", str(run_dir)])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == str(run_dir / "report.html")
    page = (run_dir / "report.html").read_text()
    assert "failed (exit code 1)" in page and "rank 1 failed first: &lt;boom&gt;" in page
    assert "No step metrics" in page and figures(page) == {}
    assert "pipeline_parallel_degree" in page


def test_report_of_a_missing_directory_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["report", str(tmp_path / "nope")])
    assert exit_.value.code == 2
    assert "is not a directory" in capsys.readouterr().err


def test_run_directories_started_in_the_same_second_differ(tmp_path):
    now = time.time()
    made = [new_run_dir(tmp_path, "train", now) for _ in range(3)]
    stamp = time.strftime("%Y-%m-%d_%H%M%S", time.localtime(now))
    assert [p.name for p in made] == [f"{stamp}-train", f"{stamp}-train-2", f"{stamp}-train-3"]


def test_progress_off_a_terminal_is_plain_lines_with_an_eta():
    out = io.StringIO()
    progress = Progress(4, out, tty_path="")
    assert not progress.drawing
    progress.advance(step_time_s=30.0)  # the first step's time, as StepMetrics gives it
    assert progress.suffix() == " | 1/4 25% ETA 01:30", "3 more steps of 30 s"
    progress.advance()
    assert re.fullmatch(r" \| 2/4 50% ETA 00:0\d", progress.suffix()), "the second was fast"
    progress.close()
    assert out.getvalue() == "", "no bar, no carriage returns"


def test_progress_on_a_terminal_draws_a_bar(tmp_path):
    main, secondary = os.openpty()
    with os.fdopen(secondary, "w") as tty:
        progress = Progress(3, tty)
        assert progress.drawing and progress.owns_lines
        progress.advance()
        progress.write("step 1 | loss 1.0")
        progress.advance()
        progress.advance()  # the last step closes the bar
        assert not progress.drawing
    drawn = b""
    while select.select([main], [], [], 0.5)[0]:  # a terminal hands over what it holds
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: all read, and the other end is closed
            break
        if not chunk:
            break
        drawn += chunk
    os.close(main)
    drawn = drawn.decode()
    assert "\r" in drawn and "3/3" in drawn and "step 1 | loss 1.0" in drawn
    assert re.search(r"\d+%\|", drawn), drawn
