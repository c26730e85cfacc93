"""Make docs/images/report.png, the README's picture of a report.html: a 2-rank pipeline
run of train_observed.py (pipeline_parallel_degree 2, 4 microbatches, on the CPU), then
a screenshot of the run's report.html in Chromium.

    python examples/pipeline/make_report_image.py                  # 40 steps, ~1 min
    python examples/pipeline/make_report_image.py --steps 8 --out /tmp/report.png

Needs the dev extras (playwright) and a Chromium: Debian's ``chromium`` package, or
``python -m playwright install chromium``. The run directory is kept under --work.
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONFIG = {"pipeline_parallel_degree": 2, "microbatches": 4}


def run_pipeline(work: Path, steps: int) -> Path:
    """Train train_observed.py on 2 pipeline ranks; the run directory."""
    config, run_dir = work / "pp.json", work / "run"
    config.write_text(json.dumps(CONFIG))
    cmd = [sys.executable, "-m", "modelparallel", "run", "--nproc-per-node", "2",
           "--config", str(config), "--run-dir", str(run_dir),
           "examples/pipeline/train_observed.py", "--steps", str(steps),
           "--record-step", str(min(10, steps))]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)  # the report shows the script as run here
    return run_dir


def screenshot(report: Path, out: Path) -> None:
    """The whole page, 1000 CSS pixels wide, as a PNG."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"),
                                    args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 800})
            page.goto(report.as_uri())
            page.screenshot(path=str(out), full_page=True)
        finally:
            browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=REPO / "docs/images/report.png")
    parser.add_argument("--work", type=Path, default=None,
                        help="where the run directory goes (default: a new temporary one)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="report-image-"))
    work.mkdir(parents=True, exist_ok=True)
    run_dir = run_pipeline(work.resolve(), args.steps)
    screenshot(run_dir / "report.html", args.out)
    print(f"wrote {args.out} from {run_dir / 'report.html'}")


if __name__ == "__main__":
    main()
