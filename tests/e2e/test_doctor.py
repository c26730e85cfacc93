"""The doctor on ten injected faults (tests/e2e/faults/faults.py, rank 1 at fault; 3
ranks where a majority names the rank that diverged, else 2): each run ends, the
summary names the right rank and the right lines, and no process is left behind. The
time bound is generous (behaviour, not speed): hangs end within collective_timeout
(15 s for the stalls) + 60 s once the ranks are up."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

FAULTS = Path(__file__).parent / "faults" / "faults.py"
STALL_TIMEOUT = 15  # the stalls end at the collective timeout
TIMEOUT = 60  # the other faults are found before it; it also bounds start-up skew
THREE_RANKS = {"skipped_collective", "extra_collective", "shape_mismatch", "dtype_mismatch"}


def markers_in(kind: str) -> dict[str, int]:
    """The markers of one fault's function."""
    text = FAULTS.read_text().splitlines()
    start = next(i for i, t in enumerate(text) if t.startswith(f"def {kind}("))
    out = {}
    for number in range(start + 1, len(text)):
        if text[number].startswith("def "):
            break
        if m := re.search(r"# <- (\w+)", text[number]):
            out[m.group(1)] = number + 1
    return out


EXPECTED = {  # the phrases each fault's summary must hold; ``at[marker]`` is file:line
    "stall_in_user_code": lambda at: [  # (the run that was test_no_hang's first test)
        "collective timeout: rank 0 waited", f"all_reduce(4, float32) at {at['wait']}",
        f"rank 1 did not arrive: it is at {at['stall']}",
        f"hint: a collective waited longer than collective_timeout={STALL_TIMEOUT}s",
        "error: RuntimeError: ", f"Timed out waiting {STALL_TIMEOUT * 1000}ms"],
    "stall_in_library_collective": lambda at: [
        "collective timeout on rank", f"rank 1 did not arrive: it is at {at['stall']}"],
    "skipped_collective": lambda at: [
        "but rank 1 finished after", "first difference: call #", at["skipped"], at["wait"]],
    "extra_collective": lambda at: [
        "rank 1 waits in collective #", "but ranks 0, 2 finished after", at["extra"]],
    "shape_mismatch": lambda at: [
        "ranks diverged", "ranks 0, 2: all_reduce(4, float32)",
        f"rank 1: all_reduce(2, float32) at {at['mismatch']} <- diverged"],
    "dtype_mismatch": lambda at: [
        "ranks diverged", f"rank 1: all_reduce(4, float64) at {at['mismatch']} <- diverged"],
    "wrong_group": lambda at: [
        "deadlock: each of these ranks waits for the next", "rank 1 waits for rank",
        f"all_reduce(4, float32) at {at['mismatch']}"],
    "exception_on_one_rank": lambda at: [
        "rank 1 (local rank 1) failed first with exit code 1",
        "ValueError: rank 1 cannot go on", f"in your code: {at['raise']}"],
    "killed_rank": lambda at: ["rank 1 (local rank 1) failed first with signal SIGKILL"],
    "point_to_point_deadlock": lambda at: [
        "deadlock",
        f"rank 0 waits for rank 1 in recv(4, float32) from rank 1 at {at['recv']}",
        f"rank 1 waits for rank 0 in recv(4, float32) from rank 0 at {at['recv']}"],
}


def expected(kind: str, path: str) -> list[str]:
    return EXPECTED[kind]({k: f"{path}:{n}" for k, n in markers_in(kind).items()})


KINDS = list(EXPECTED)


# the longest waits (a stall in the library's collective, and a fault after a restart)
# run in the extended tier; the default tier has a stall in user code and the wrong group
LONG = {("stall_in_library_collective", 0), ("wrong_group", 1)}
CASES = [pytest.param(kind, restarts, marks=[pytest.mark.extended] if (kind, restarts) in LONG
                      else []) for kind, restarts in [*((k, 0) for k in KINDS),
                                                      ("wrong_group", 1)]]


@pytest.mark.parametrize(("kind", "restarts"), CASES)
def test_the_doctor_names_the_rank_and_the_line(modelparallel, tmp_path, kind, restarts):
    """``restarts`` 1: the launcher does not share its store with the ranks (the doctor
    uses the one rank 0 hosts), and the fault comes back after the restart."""
    script = tmp_path / "faults.py"
    shutil.copy(FAULTS, script)
    timeout = STALL_TIMEOUT if kind.startswith("stall") else TIMEOUT
    nproc = 3 if kind in THREE_RANKS else 2
    ran = modelparallel("run", "--nproc-per-node", nproc, "--max-restarts", restarts, script,
                        kind, timeout, timeout=400)
    assert "doctor is off" not in ran.err, ran.err
    assert ran.code != 0, ran.all
    summary = ran.err[ran.err.rindex("=" * 72, 0, ran.err.rindex("=" * 72)):]
    for phrase in expected(kind, str(script)):
        assert phrase in summary, f"{phrase!r} not in:\n{summary}"
    assert len(summary.splitlines()) <= 25, summary
    assert ran.seconds < STALL_TIMEOUT + 60 + 90, ran.seconds  # + start-up, loaded
    left = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True)
    assert left.stdout == "", f"processes left behind: {left.stdout}"
