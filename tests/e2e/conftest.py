import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


class Ran:
    def __init__(self, proc: subprocess.CompletedProcess, seconds: float):
        self.code = proc.returncode
        self.out = proc.stdout
        self.err = proc.stderr
        self.all = proc.stdout + proc.stderr
        self.seconds = seconds


@pytest.fixture
def modelparallel():
    """Run the `modelparallel` command as a user would; returns what it printed."""

    def run(*args: str, timeout: float = 300, cwd: Path | None = None) -> Ran:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MP_", "RANK"))}
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "modelparallel", *map(str, args)],
                              capture_output=True, text=True, timeout=timeout,
                              cwd=cwd or REPO, env=env)
        return Ran(proc, time.monotonic() - start)

    return run
