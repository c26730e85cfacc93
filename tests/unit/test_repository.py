"""The repository keeps its promises: lint-clean code, docs that name every key."""

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

from modelparallel.config import Config

REPO = Path(__file__).resolve().parents[2]


def test_ruff_passes():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    proc = subprocess.run([ruff, "check", "."], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_passes_on_the_package():
    """The type checker, configured in pyproject.toml ([tool.mypy]), over src/."""
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_configuration_doc_lists_every_key():
    doc = (REPO / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `(\w+)` \|", doc, flags=re.M))
    assert documented == {f.name for f in dataclasses.fields(Config)}


def test_readme_quick_start_is_what_ci_runs():
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"```bash\n(python3 -m venv[^\n]*)\n```", readme)
    assert len(commands) == 2, "the quick start has exactly two commands"
    ci = (REPO / ".ci" / "run").read_text()
    assert commands[1] in ci
