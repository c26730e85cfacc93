"""What ``modelparallel run`` says when a rank exits with a code, when the group
restarts, when output is filtered by rank, and when the run directory cannot be used."""

from __future__ import annotations

import json
import os
from pathlib import Path


def unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot make (root may write anywhere but /sys)."""
    if os.geteuid() == 0:
        return Path("/sys/modelparallel-run-test")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    return locked / "run"


def test_sys_exit_is_named_and_each_restart_announced(modelparallel, script, tmp_path):
    path = script("""
        import os, pathlib, sys, time
        print("hello from rank", os.environ["RANK"], flush=True)
        # rank 1 fails once rank 0 has said hello (else the group may stop rank 0 first)
        said = pathlib.Path(__file__).with_name(
            "said-" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if os.environ["RANK"] == "0":
            said.touch()
        else:
            while not said.exists():
                time.sleep(0.05)
            time.sleep(1)  # the launcher's tail of rank 0's output reads it meanwhile
            sys.exit(3)
    """)
    run_dir = tmp_path / "run"
    ran = modelparallel("run", "--nproc_per_node", 2, "--max_restarts", 1, "--ranks-filter",
                        0, "--run-dir", run_dir, path, timeout=240)
    assert ran.code == 3, ran.all
    restarts = [line for line in ran.err.splitlines() if "restarting" in line]
    assert restarts == [f"modelparallel run: rank 1 failed (exit code 3, SystemExit: the "
                        f"script exited with code 3 at {path}:13); restarting the worker "
                        f"group (restart 1 of 1)"], ran.err
    assert "rank 1 (local rank 1) failed first with exit code 3" in ran.err
    assert "  error: SystemExit: the script exited with code 3" in ran.err
    assert f"  in your code: {path}:13: sys.exit(3)" in ran.err
    assert "To enable traceback" not in ran.all
    # rank 1's output is filtered from the terminal, not from its log
    assert ran.out.count("[rank0]: hello from rank 0") == 2 and "rank 1" not in ran.out
    logs = [p.read_text() for p in (run_dir / "logs").rglob("stdout.log")]
    assert sum("hello from rank 1" in text for text in logs) == 2, logs


def test_a_run_directory_belongs_to_one_run(modelparallel, script, tmp_path, clean_env):
    run_dir = tmp_path / "shared"
    first = modelparallel("run", "--run-dir", run_dir, script("print('first')\n", "a.py"))
    assert first.code == 0, first.all
    outcome = (run_dir / "outcome.json").read_text()
    second = modelparallel("run", "--run-dir", run_dir, script("print('second')\n", "b.py"))
    assert second.code == 2, second.all
    lines = second.err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"modelparallel run: {run_dir} holds another run (shared, "
                               f"started "), lines
    assert lines[0].endswith("to continue that run there, set MP_RUN_ID=shared")
    assert (run_dir / "outcome.json").read_text() == outcome, "the first run's files stay"
    assert json.loads((run_dir / "config.json").read_text())["launch"]["script"].endswith(
        "a.py")
    clean_env["MP_RUN_ID"] = "shared"  # what a requeued job passes on: the same run
    again = modelparallel("run", "--run-dir", run_dir, script("print('again')\n", "a.py"))
    assert again.code == 0, again.all
    assert f"modelparallel run: continuing run shared in {run_dir}" in again.err


def test_an_unwritable_run_directory_is_one_line_and_exit_code_2(modelparallel, script,
                                                                 tmp_path):
    path = unwritable_dir(tmp_path)
    ran = modelparallel("run", "--run-dir", path, script("print('never')\n"))
    assert ran.code == 2, ran.all
    assert ran.err.splitlines() == [ran.err.strip()], ran.err
    assert ran.err.startswith(f"modelparallel run: cannot write the run directory {path}: ")
    assert "give --run-dir a directory you can write" in ran.err and os.path.exists(
        os.path.dirname(path))
