"""Run directories: what one real ``modelparallel run`` leaves behind (config, logs,
metrics, TensorBoard events, the pipeline schedule, report.html), the progress bar on
the launcher's terminal, the report in a real browser, and a failed run's directory.

One 2-rank pipeline run (started in a pseudo-terminal, as from a shell) serves most
tests; a second run fails on purpose.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

STEPS = 4
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT", "MP_CONFIG", "MP_RUN_DIR", "MP_RUN_ID", "MP_METRICS_FILE",
                      "MP_PROGRESS_TTY")
PLOTS = ("loss", "throughput", "step_time", "memory", "comm", "schedule", "busy")

PIPELINE_SCRIPT = """
import contextlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import modelparallel as smp

steps = int(sys.argv[1])


@smp.step
def train_step(model, x, y):
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


smp.init({"pipeline_parallel_degree": 2, "microbatches": 4})
torch.manual_seed(0)
model = smp.DistributedModel(nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]))
opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
metrics = smp.observe.StepMetrics(total_steps=steps)
for step in range(steps):
    x = torch.randn(16, 32)
    recording = model.record_schedule() if step == 2 else contextlib.nullcontext()
    with metrics.step(samples=16) as rec, recording:
        opt.zero_grad()
        loss = train_step(model, x, x.flip(1)).reduce_mean()
        opt.step()
        rec.loss = loss
"""


def environment(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["MODELPARALLEL_RUNS_DIR"] = str(root / "runs")
    return env


def run_in_terminal(args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> str:
    """Run ``modelparallel ARGS`` with a pseudo-terminal as its output; what it showed."""
    main, secondary = os.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "modelparallel", *args], cwd=cwd, env=env,
                            stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary)
    os.close(secondary)
    shown, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([main], [], [], 1.0)[0]:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # every writer closed the terminal
                    break
                if not chunk:
                    break
                shown += chunk
            elif proc.poll() is not None and not select.select([main], [], [], 0.5)[0]:
                break
        else:
            proc.kill()
            pytest.fail(f"modelparallel run took over {timeout} s:\n{shown.decode()}")
    finally:
        os.close(main)
        proc.wait(timeout=60)
    assert proc.returncode == 0, shown.decode(errors="replace")
    return shown.decode(errors="replace")


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    """(run directory, what the terminal showed) of one 2-rank pipeline run."""
    root = tmp_path_factory.mktemp("run_dir")
    (root / "pp_train.py").write_text(textwrap.dedent(PIPELINE_SCRIPT))
    shown = run_in_terminal(["run", "--nproc-per-node", "2", "pp_train.py", str(STEPS)],
                            root, environment(root), timeout=300)
    made = list((root / "runs").iterdir())
    assert len(made) == 1, made
    return made[0], shown


def test_the_run_directory_holds_the_run(pipeline_run):
    run_dir, shown = pipeline_run
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d{6}-pp_train", run_dir.name)
    assert shown.count(f"run directory runs/{run_dir.name}") == 2, "printed at start and end"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["launch"]["nproc_per_node"] == 2 and config["launch"]["script"] == "pp_train.py"
    assert config["launch"]["script_args"] == [str(STEPS)]
    assert config["config"]["collective_timeout"] == 600, "resolved with the defaults"
    layout = json.loads((run_dir / "layout.json").read_text())
    assert layout["topology"]["dims"]["pp"] == 2 and layout["config"]["microbatches"] == 4
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    assert {r["run"] for r in lines} == {run_dir.name} and {r["attempt"] for r in lines} == {0}
    assert set(lines[-1]["comm_bytes"]) == {"pp"}
    (schedule,) = json.loads((run_dir / "schedule.json").read_text())
    assert {(e["rank"], e["kind"]) for e in schedule["events"]} == {
        (r, k) for r in (0, 1) for k in "FB"}
    assert json.loads((run_dir / "outcome.json").read_text())["exit_code"] == 0


def test_each_rank_logs_plain_lines_into_the_run_directory(pipeline_run):
    run_dir, _ = pipeline_run
    logs = {int(p.parent.name): p.read_text() for p in (run_dir / "logs").rglob("stdout.log")}
    assert set(logs) == {0, 1}
    assert "\r" not in logs[0], "no progress bar in a log file"
    eta = re.findall(r"step +(\d+) \| loss .* \| (\d+)/4 \d+% ETA \d\d:\d\d$", logs[0], re.M)
    assert [int(s) for s, _ in eta] == list(range(1, STEPS + 1))


def test_the_launchers_terminal_shows_a_progress_bar(pipeline_run):
    _, shown = pipeline_run
    bars = re.findall(r"\rtrain: +(\d+)%\|[^\r\n]*\| (\d)/4 \[", shown)
    assert bars and bars[-1] == ("100", "4"), shown


def test_tensorboard_events_hold_the_scalars(pipeline_run):
    loader = pytest.importorskip("tensorboard.backend.event_processing.event_file_loader")
    run_dir, _ = pipeline_run
    (events,) = run_dir.glob("events.out.tfevents.*")
    tags: dict[str, list[int]] = {}
    for event in loader.EventFileLoader(str(events)).Load():
        for value in event.summary.value:
            tags.setdefault(value.tag, []).append(event.step)
    assert {"loss", "step_time_ms", "throughput/samples_per_s", "memory/peak_tensors_MiB",
            "comm_MiB/pp"} <= set(tags)
    assert tags["loss"] == list(range(1, STEPS + 1))
    assert tags["memory/peak_tensors_MiB"] == [1, 2, 3], "only the steps whose memory was measured"


def test_the_report_renders_in_a_browser(pipeline_run, tmp_path):
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(chromium):
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    image = pytest.importorskip("PIL.Image")
    run_dir, _ = pipeline_run
    errors: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: errors.append(f"request {r.url}")
                    if not r.url.startswith("file://") else None)
            page.goto((run_dir / "report.html").as_uri())
            for name in PLOTS:
                svg = page.locator(f"#plot-{name} svg")
                box = svg.bounding_box()
                assert box and box["width"] > 200 and box["height"] > 100, (name, box)
                assert svg.locator("path").count() > 5, f"{name} draws nothing"
            assert "completed (exit code 0)" in page.inner_text("#outcome")
            page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        finally:
            browser.close()
    assert errors == []
    pixels = image.open(tmp_path / "report.png").convert("RGB")
    colours = pixels.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50, "the screenshot is not blank"
    assert max(count for count, _ in colours) < 0.97 * pixels.width * pixels.height


def test_a_failed_run_keeps_its_directory_and_report(modelparallel, script, tmp_path):
    train = script("""
        print("about to fail", flush=True)
        raise ValueError("boom")
    """)
    ran = modelparallel("run", "--nproc-per-node", 2, "--run-dir", tmp_path / "mine", train,
                        timeout=180)
    assert ran.code == 1, ran.all
    run_dir = tmp_path / "mine"
    assert ran.err.count(f"run directory {run_dir}") == 2
    outcome = json.loads((run_dir / "outcome.json").read_text())
    assert outcome["exit_code"] == 1 and "ValueError: boom" in outcome["summary"]
    assert json.loads((run_dir / "config.json").read_text())["launch"]["world_size"] == 2
    assert any("about to fail" in p.read_text() for p in run_dir.rglob("stdout.log"))
    page = (run_dir / "report.html").read_text()
    assert "failed (exit code 1)" in page and "ValueError: boom" in page
    assert not (run_dir / "metrics.jsonl").exists()
