"""Run cases of the parity matrix in real processes and judge them.

Single-node cases run in :class:`~modelparallel.testing.WorkerGroup` processes, started
once per world size and reused. The 2-node cases run through the launcher as a real
multi-node job would: two ``modelparallel run --nnodes 2 --node-rank R`` agents (static
rendezvous on loopback), whose workers run the cases in ``node_driver.py`` and write
each rank's results to a file; a job stops once its processes hold many process groups
and the next job goes on with the rest.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from modelparallel.testing.workers import WorkerError, WorkerGroup
from parity_matrix import compare, train
from parity_matrix.refusals import expected_refusal
from parity_matrix.space import Case

# "pass (float64 rerun)": a case further from the float64 answer than the round-off bound
# allows, whose rerun in float64 then matched that answer (compare.exact_problems)
OK_STATUSES = ("pass", "pass (float64 rerun)", "refused as expected")


@dataclass
class Outcome:
    case: Case
    status: str  # one of OK_STATUSES, or "FAIL"
    worst: float  # the largest difference from one process, as a share of its bound
    detail: str  # why it failed, or the refusal message
    seconds: float
    judged: bool = False  # compared with the one-process reference (losses and tensors)

    @property
    def ok(self) -> bool:
        return self.status in OK_STATUSES


def judge(case: Case, results: list[train.RunResult] | None, error: str | None,
          seconds: float,
          rerun_exact: Callable[[], list[train.RunResult]] | None = None) -> Outcome:
    """The outcome of a case from its per-rank results or its error. ``rerun_exact``
    reruns the case in float64 (every rank's results; no precision policy) when its
    tensors are further from the float64 answer than round-off allows: matching the answer
    there clears it (a half-precision case only up to :data:`compare.HALF_CAP`)."""
    refusal = expected_refusal(case)
    if refusal is not None:
        key, fragment = refusal.key, refusal.fragment
        if refusal.by_config:
            checked = _check_config(case)
            if not (key in checked and fragment in checked):
                return Outcome(case, "FAIL", 0.0, f"check-config should refuse {key!r} "
                               f"({fragment!r}); it says: {checked or 'valid'}", seconds)
        if error is not None and "ConfigError" in error and key in error and fragment in error:
            ranks = error.count("--- rank ")
            if ranks == case.layout.processes:
                return Outcome(case, "refused as expected", 0.0, _config_error(error), seconds)
            return Outcome(case, "FAIL", 0.0, f"refused on {ranks} of {case.layout.processes} "
                           f"ranks only:\n{error}", seconds)
        return Outcome(case, "FAIL", 0.0, f"expected a refusal naming {key!r} ({fragment!r}); "
                       f"got: {error or 'it trained'}", seconds)
    if error is not None:
        return Outcome(case, "FAIL", 0.0, error, seconds)
    assert results is not None
    ref = _cached_reference(case)
    # a float64 case's reference is the float64 answer: judged against it directly
    float64 = case.precision == "fp64"
    sliced = None if float64 else _cached_reference(case, sliced=True)
    exact = None if float64 else _cached_reference(case, exact=True)
    found, roundoff, worst = compare.problems(case, results, ref, sliced, exact)
    if roundoff and not found and rerun_exact is not None:
        assert exact is not None
        try:
            found = compare.exact_problems(rerun_exact(), exact)
        except WorkerError as e:
            found = [f"the float64 rerun failed: {e}"]
        if not found:
            return Outcome(case, "pass (float64 rerun)", worst, "; ".join(roundoff), seconds,
                           judged=True)
    found += roundoff
    if found:
        return Outcome(case, "FAIL", worst, "\n".join(found[:20]), seconds, judged=True)
    return Outcome(case, "pass", worst, "", seconds, judged=True)


_REFERENCES: dict[tuple, train.RunResult] = {}


def _cached_reference(case: Case, *, sliced: bool = False,
                      exact: bool = False) -> train.RunResult:
    # cases with equal keys share one reference: same model, depth, data, precision (the
    # float64 answer has none), cut, dropout, padding
    key = (case.model, case.layers, case.rows, "float64" if exact else case.precision,
           train.slices(case) if sliced else 1, case.dropout, case.padded,
           case.unused, case.load_balancing)
    if key not in _REFERENCES:
        _REFERENCES[key] = train.reference(case, sliced=sliced, exact=exact)
    return _REFERENCES[key]


def _check_config(case: Case) -> str:
    """What ``modelparallel check-config`` says of the case's configuration ('' if valid)."""
    from modelparallel.config import Config, ConfigError
    from modelparallel.topology import check_world

    try:
        check_world(Config.load(case.config(), environ={}), case.layout.processes)
    except ConfigError as e:
        return str(e)
    return ""


def _config_error(error: str) -> str:
    lines = [ln.strip() for ln in error.splitlines() if "ConfigError" in ln or ln.strip()
             .startswith("- ")]
    return " ".join(lines[:3])[:300]


# -- one node ----------------------------------------------------------------------------------

def run_on_group(group: WorkerGroup, case: Case) -> Outcome:
    start = time.monotonic()
    try:
        results = group.run(train.run_rank, case_dict=case.as_dict())
        error = None
    except WorkerError as e:
        results, error = None, str(e)
    return judge(case, results, error, time.monotonic() - start,
                 lambda: group.run(train.run_rank, case_dict=case.as_dict(), exact=True))


def run_cases(cases: Iterable[Case], *, on_outcome: Callable[[Outcome], None] | None = None,
              case_timeout_s: float = 600) -> list[Outcome]:
    """Run ``cases`` (single-node ones by world size in worker groups, the 2-node ones in
    one multi-node launch) and judge each; ``on_outcome`` sees each as it comes."""
    cases = list(cases)
    outcomes = []
    single = sorted((c for c in cases if c.layout.nodes == 1),
                    key=lambda c: (c.layout.processes, c.id))
    for world in sorted({c.layout.processes for c in single}):
        with WorkerGroup(world, case_timeout_s=case_timeout_s) as group:
            for case in (c for c in single if c.layout.processes == world):
                outcome = run_on_group(group, case)
                outcomes.append(outcome)
                if on_outcome:
                    on_outcome(outcome)
    multi = [c for c in cases if c.layout.nodes > 1]
    if multi:
        for outcome in run_multinode(multi):
            outcomes.append(outcome)
            if on_outcome:
                on_outcome(outcome)
    return outcomes


# -- two nodes ---------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_multinode(cases: list[Case], timeout_s: float = 3600,
                  max_gloo_groups: int = 64) -> Iterator[Outcome]:
    """Run 2 x 2 cases as jobs of two launcher agents; yield their outcomes.

    A job runs cases until its processes hold more than ``max_gloo_groups`` gloo groups
    (see :func:`~modelparallel.testing.workers.gloo_loops`), then stops and the next job
    takes the rest. A job that dies fails the case it was running, and only that one.
    A case's float64 rerun (see :func:`judge`) runs on 4 processes of this node:
    the same layout and collectives, without a relaunch.
    """
    with contextlib.ExitStack() as stack:
        local: list[WorkerGroup] = []

        def rerun_exact(case: Case) -> list[train.RunResult]:
            if not local:
                local.append(stack.enter_context(WorkerGroup(case.layout.processes)))
            return local[0].run(train.run_rank, case_dict=case.as_dict(), exact=True)

        yield from _run_node_jobs(cases, timeout_s, max_gloo_groups, rerun_exact)


def _run_node_jobs(cases: list[Case], timeout_s: float, max_gloo_groups: int,
                   rerun_exact: Callable[[Case], list[train.RunResult]]) -> Iterator[Outcome]:
    deadline = time.monotonic() + timeout_s
    remaining = list(cases)
    while remaining:
        per_rank, crashed, tails = _launch_nodes(remaining, deadline - time.monotonic(),
                                               max_gloo_groups)
        finished = []
        for case in remaining:
            if any(case.id not in r for r in per_rank):
                break  # cases run in order: none after this one finished either
            got = [r[case.id] for r in per_rank]
            finished.append(case)
            errors = [(rank, e) for rank, (_, e, _) in enumerate(got) if e is not None]
            seconds = max(s for _, _, s in got)
            if errors:
                text = f"{case.id} failed on 4 ranks:\n" + "\n".join(
                    f"--- rank {rank} ---\n{e}" for rank, e in errors)
                yield judge(case, None, text, seconds)
            else:
                yield judge(case, [r for r, _, _ in got], None, seconds,
                            functools.partial(rerun_exact, case))
        remaining = remaining[len(finished):]
        if remaining and (crashed or not finished or time.monotonic() > deadline):
            # the job died (or ran out of time) in this case
            case, remaining = remaining[0], remaining[1:]
            yield judge(case, None, "the 2-node job ended in this case:\n" + tails, 0.0)
            if time.monotonic() > deadline:
                for case in remaining:
                    yield judge(case, None, f"not run: the 2-node jobs took over {timeout_s:.0f}s",
                                0.0)
                return


def _launch_nodes(cases: list[Case], timeout_s: float,
                  max_gloo_groups: int) -> tuple[list[dict[str, tuple]], bool, str]:
    """One 2-node job over ``cases``: each rank's results, whether it crashed, its log tail."""
    driver = Path(__file__).with_name("node_driver.py")
    with tempfile.TemporaryDirectory(prefix="mp-matrix-") as tmp:
        spec = Path(tmp, "cases.pkl")
        spec.write_bytes(pickle.dumps([c.as_dict() for c in cases]))
        port = _free_port()
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        start = time.monotonic()
        # each agent writes to its own file: a pipe read only after the other agent ends
        # would fill up and stall the whole job
        logs = [Path(tmp, f"node{node}.log") for node in (0, 1)]
        agents = []
        for node, log_path in enumerate(logs):
            with log_path.open("w") as out:
                agents.append(subprocess.Popen(
                    [sys.executable, "-m", "modelparallel", "run", "--nnodes", "2",
                     "--node-rank", str(node), "--nproc-per-node", "2", "--rdzv-endpoint",
                     f"127.0.0.1:{port}", "--run-dir", str(Path(tmp, f"run{node}")),
                     str(driver), str(spec), tmp, str(max_gloo_groups)],
                    env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        try:
            _wait_agents(agents, deadline=start + timeout_s)
        finally:  # past the limit, or interrupted: the agents and their workers, all of them
            for agent in agents:
                if agent.poll() is None:
                    os.killpg(agent.pid, signal.SIGKILL)
                    agent.wait()
        crashed = any(agent.returncode != 0 for agent in agents)
        tails = "\n".join(path.read_text(errors="replace")[-3000:] for path in logs)
        per_rank = []
        for rank in range(4):
            path = Path(tmp, f"rank{rank}.pkl")
            per_rank.append(pickle.loads(path.read_bytes()) if path.exists() else {})
        return per_rank, crashed, tails


def _wait_agents(agents: list[subprocess.Popen], deadline: float, grace_s: float = 30) -> None:
    """Wait until every agent ends, the deadline passes, or ``grace_s`` after one failed.

    The agents of a static rendezvous do not watch each other: when one node's workers die,
    the other's may wait for them for the 30 minutes of torch's default group-creation
    timeout, so they get ``grace_s`` to fail on their own.
    """
    while time.monotonic() < deadline:
        codes = [agent.poll() for agent in agents]
        if all(code is not None for code in codes):
            return
        if any(code not in (None, 0) for code in codes):
            deadline = min(deadline, time.monotonic() + grace_s)
        time.sleep(0.5)
