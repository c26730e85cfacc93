"""The README's picture of report.html comes from a shipped example:
examples/pipeline/make_report_image.py runs train_observed.py on 2 pipeline ranks and
screenshots the run's report in Chromium."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAKER = REPO / "examples" / "pipeline" / "make_report_image.py"


@pytest.mark.extended  # a pipeline run and a browser; test_run_dir covers the report
def test_make_report_image_takes_the_picture_of_a_pipeline_run(clean_env, tmp_path):
    if not os.path.exists(shutil.which("chromium") or "/usr/bin/chromium"):
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    image = pytest.importorskip("PIL.Image")
    out = tmp_path / "report.png"
    ran = subprocess.run([sys.executable, str(MAKER), "--steps", "6", "--out", str(out),
                          "--work", str(tmp_path / "work")], cwd=tmp_path, env=clean_env,
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    run_dir = tmp_path / "work" / "run"
    assert f"wrote {out} from {run_dir / 'report.html'}" in ran.stdout
    layout = json.loads((run_dir / "layout.json").read_text())
    assert layout["topology"]["dims"]["pp"] == 2, "a pipeline run, as the README says"
    (schedule,) = json.loads((run_dir / "schedule.json").read_text())
    assert schedule["ranks"] == 2 and schedule["microbatches"] == 4
    page = (run_dir / "report.html").read_text()
    assert "examples/pipeline/train_observed.py --steps 6" in page
    assert 'id="plot-schedule"' in page and 'id="plot-memory"' in page
    pixels = image.open(out).convert("RGB")
    assert pixels.width == 1000 and pixels.height > 2000, pixels.size
    colours = pixels.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50, "the screenshot is not blank"
