"""No process of a run outlives ``modelparallel run``, whatever its ranks do.

Every rank here first starts a stubborn child: a process in a session of its own (so
torchrun's signal to the worker's process group misses it), ignoring SIGTERM and
blocked reading a pipe, like the orphans of issue 28. Then the ranks hang or fail in one
phase of a run: import, init, the first step of a pipeline, exit; or the launcher itself
is SIGKILLed. Afterwards no process carrying the test's mark in its environment may be
left, and the launcher must have ended soon after the failure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from procs import alive

BOUND_S = 60  # from the failure to the launcher's end
PREAMBLE = """
import os, subprocess, sys, time
from pathlib import Path
EVENTS = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
STUBBORN = ("import os, signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "r, w = os.pipe(); os.read(r, 1)")
subprocess.Popen([sys.executable, "-c", STUBBORN], start_new_session=True)


def note(what):  # when a rank reached a point, for the test
    (EVENTS / f"{what}.{RANK}").write_text(str(time.time()))
"""


def marked_processes(token: str) -> list[int]:
    """Live processes whose environment holds the test's mark."""
    entry = f"\0MP_TEST_MARK={token}\0".encode()
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and entry in b"\0" + (proc / "environ").read_bytes() + \
                    b"\0" and alive(int(proc.name)):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def assert_none_left(token: str, within_s: float = 15.0) -> None:
    deadline = time.monotonic() + within_s
    while (left := marked_processes(token)) and time.monotonic() < deadline:
        time.sleep(0.5)
    described = [Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:120]
                 for p in left if Path(f"/proc/{p}").exists()]
    for pid in left:  # leave nothing behind for the next test
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the run outlived it: {described}"


class Launch:
    """One ``modelparallel run`` of a script, in the background, with a mark of its own."""

    def __init__(self, tmp_path: Path, clean_env: dict[str, str], body: str, nproc: int = 2):
        self.token = uuid.uuid4().hex
        self.events = tmp_path / "events"
        self.events.mkdir()
        path = tmp_path / "phase.py"
        path.write_text(PREAMBLE + textwrap.dedent(body))
        env = {**clean_env, "MP_TEST_MARK": self.token}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "modelparallel", "run", "--nproc-per-node", str(nproc),
             str(path), str(self.events)], env=env, cwd=tmp_path, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def wait_for(self, what: str, count: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while len(list(self.events.glob(f"{what}.*"))) < count:
            assert self.proc.poll() is None, self.proc.communicate()
            assert time.monotonic() < deadline, f"no {what} within {timeout}s"
            time.sleep(0.3)

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            pytest.fail(f"the launcher did not end within {timeout}s:\n{out}\n{err}")
        return self.proc.returncode, out + err

    def seconds_since(self, what: str) -> float:
        times = [float(p.read_text()) for p in self.events.glob(f"{what}.*")]
        assert times, f"no rank reached {what}"
        return time.time() - min(times)


def check_failed_run(launch: Launch) -> str:
    code, shown = launch.finish()
    took = launch.seconds_since("failing")
    assert code != 0, shown
    assert took < BOUND_S, f"the launcher ended {took:.0f}s after the failure\n{shown}"
    assert_none_left(launch.token)
    return shown


def test_ranks_hanging_in_import(tmp_path, clean_env):
    launch = Launch(tmp_path, clean_env, """
        if RANK == 1:
            note("failing")
            raise ImportError("no module named the_missing_one")
        time.sleep(3600)  # rank 0 hangs while importing
    """)
    assert "ImportError: no module named the_missing_one" in check_failed_run(launch)


def test_ranks_hanging_in_init(tmp_path, clean_env):
    launch = Launch(tmp_path, clean_env, """
        import modelparallel as mp
        if RANK == 1:
            note("failing")
            raise RuntimeError("rank 1 fails before init")
        mp.init()  # waits for rank 1 forever
    """)
    assert "rank 1 fails before init" in check_failed_run(launch)


@pytest.mark.extended
def test_every_rank_failing_in_the_first_step_of_a_pipeline(tmp_path, clean_env):
    launch = Launch(tmp_path, clean_env, """
        import torch
        import torch.nn as nn
        import modelparallel as smp

        @smp.step
        def train_step(model, x):
            out = model(x)
            note("failing")
            raise RuntimeError("the first step fails")

        smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
        model = smp.DistributedModel(nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]))
        train_step(model, torch.randn(4, 8))
    """)
    assert "the first step fails" in check_failed_run(launch)


@pytest.mark.extended
def test_a_rank_hanging_at_exit_and_ignoring_sigterm(tmp_path, clean_env):
    """torchrun SIGKILLs it after its shutdown timeout (30 s); its child goes too."""
    launch = Launch(tmp_path, clean_env, """
        import atexit, signal
        if RANK == 1:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            atexit.register(time.sleep, 3600)  # hangs at exit
            note("exiting")
            sys.exit(0)
        while not list(EVENTS.glob("exiting.*")):
            time.sleep(0.2)
        note("failing")
        raise RuntimeError("rank 0 fails while rank 1 exits")
    """)
    assert "rank 0 fails while rank 1 exits" in check_failed_run(launch)


def test_the_launcher_sigkilled_mid_run_takes_its_ranks_along(tmp_path, clean_env):
    launch = Launch(tmp_path, clean_env, """
        note("running")
        time.sleep(3600)
    """)
    launch.wait_for("running", 2)
    launch.proc.kill()
    launch.proc.wait()
    assert_none_left(launch.token)


def test_ctrl_c_ends_every_process_with_one_line_and_130(tmp_path, clean_env):
    launch = Launch(tmp_path, clean_env, """
        note("running")
        time.sleep(3600)
    """)
    launch.wait_for("running", 2)
    launch.proc.send_signal(signal.SIGINT)
    code, shown = launch.finish(timeout=120)
    assert code == 130, shown
    assert "Traceback" not in shown and "SignalException" not in shown, shown
    after = shown[shown.index("modelparallel run: stopped"):].splitlines()
    assert after[0] == ("modelparallel run: stopped by SIGINT (Ctrl-C); every process of "
                        "the run has ended"), shown
    assert len(after) == 2 and after[1].startswith("modelparallel run: run directory"), shown
    assert_none_left(launch.token)
