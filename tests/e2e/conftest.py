import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from jobs_fixture import jobs  # noqa: F401  (a fixture for the job tests)

REPO = Path(__file__).resolve().parents[2]


class Ran:
    def __init__(self, proc: subprocess.CompletedProcess, seconds: float):
        self.code = proc.returncode
        self.out = proc.stdout
        self.err = proc.stderr
        self.all = proc.stdout + proc.stderr
        self.seconds = seconds


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT", "MP_CONFIG")


@pytest.fixture
def clean_env(tmp_path) -> dict[str, str]:
    """This environment without anything a launcher sets, as in a fresh shell; run
    directories go under the test's own directory, not the repository's runs/."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["MODELPARALLEL_RUNS_DIR"] = str(tmp_path / "runs")
    return env


@pytest.fixture
def modelparallel(clean_env):
    """Run the `modelparallel` command as a user would; returns what it printed."""

    def run(*args: str, timeout: float = 300, cwd: Path | None = None) -> Ran:
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "modelparallel", *map(str, args)],
                              capture_output=True, text=True, timeout=timeout,
                              cwd=cwd or REPO, env=clean_env)
        return Ran(proc, time.monotonic() - start)

    return run


@pytest.fixture
def script(tmp_path):
    """Write a script (dedented) into the test's directory; returns its path."""

    def write(body: str, name: str = "train.py"):
        path = tmp_path / name
        path.write_text(textwrap.dedent(body))
        return path

    return write
