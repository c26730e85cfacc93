"""The process that sees one job attempt through: ``python -m modelparallel.jobs.runner``.

Started detached by ``Estimator.fit`` / ``modelparallel jobs submit``, it restores the
checkpoints, starts the instances on the backend, writes their output to ``job.log``,
records status transitions and metrics in the store, syncs checkpoints, enforces
``max_run``, handles ``stop`` (SIGTERM), and records how the job ended.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from modelparallel.jobs import artifacts
from modelparallel.jobs.backends import JobContext, backend_class
from modelparallel.jobs.layout import JobLayout
from modelparallel.jobs.metrics import LogMetrics, StepMetricsFile
from modelparallel.jobs.spec import JobSpec
from modelparallel.jobs.store import JobStore

POLL_S = 0.2
CHECKPOINT_SYNC_S = 30.0
# once an instance has failed, the others get this long to notice before being stopped
# (an instance that fails before the rendezvous would leave the others waiting for it)
FAILED_PEER_GRACE_S = 15.0
_PEER_GONE = re.compile(r"connection (closed|reset) by peer|remote process exited|"
                        r"timed out waiting|RendezvousClosedError|failed first with signal "
                        r"SIGTERM|stopped by SIG", re.IGNORECASE)


class Runner:
    def __init__(self, store: JobStore, layout: JobLayout):
        self.store = store
        self.layout = layout
        self.spec = JobSpec.from_json(layout.spec.read_text())
        self.name = self.spec.name
        self.attempt = store.require(self.name)["attempt"]
        self.backend = backend_class(self.spec.backend)(self.spec.backend_options)
        self.log: TextIO = layout.log.open("a", buffering=1)
        self.log_metrics = LogMetrics(self.spec.metric_definitions)
        self.step_metrics = StepMetricsFile(layout.metrics(0))
        self.stop_reason: str | None = None

    def say(self, text: str) -> None:
        self.log.write(f"[modelparallel] {text}\n")

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stop_reason = self.stop_reason or f"stopped ({signal.Signals(signum).name})"

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.store.update(self.name, runner_pid=os.getpid(), runner_host=socket.gethostname())
        self.say(f"job {self.name} attempt {self.attempt}: {self.spec.instance_count} "
                 f"instance(s) x {self.spec.processes_per_host} process(es) on the "
                 f"{self.spec.backend} backend")
        self.store.transition(self.name, "Starting")
        try:
            self._restore_checkpoints()
            job = JobContext(self.spec, self.layout, self.attempt)
            self.backend.start(job)
            self.store.update(self.name, backend_info=self.backend.info(),
                              layout=_describe_layout(self.spec))
            self.store.transition(self.name, "Training")
            self._follow()
        except Exception as e:  # the backend could not start, a sync failed, ...
            self.say(f"error: {type(e).__name__}: {e}")
            self._stop_backend()
            self._close_backend()
            self.store.update(self.name, failure_reason=f"{type(e).__name__}: {e}")
            self.store.transition(self.name, "Failed", str(e))
            return 1
        return self._finish()

    def _restore_checkpoints(self) -> None:
        # an earlier attempt's model is not this attempt's
        artifacts.remove(artifacts.join(self.spec.output_path, self.name, "output",
                                        "model.tar.gz"))
        uri = self.spec.checkpoint_uri
        if uri is None:
            return
        shutil.rmtree(self.layout.checkpoints, ignore_errors=True)
        self.layout.checkpoints.mkdir(parents=True)
        count = artifacts.restore(uri, self.layout.checkpoints)
        if count:
            self.say(f"restored {count} checkpoint file(s) from {uri}")

    def _follow(self) -> None:
        started = time.monotonic()
        last_sync = started
        failed_at: float | None = None
        stopping = False
        while True:
            lines, done = self.backend.poll()
            self._record(lines)
            if done:
                return
            now = time.monotonic()
            if self.spec.max_run and now - started > self.spec.max_run and not stopping:
                self.stop_reason = self.stop_reason or (
                    f"MaxRuntimeExceeded: the job ran longer than max_run="
                    f"{self.spec.max_run:g}s")
            codes = self.backend.exit_codes()
            if failed_at is None and any(c not in (None, 0) for c in codes.values()):
                failed_at = now
            if failed_at is not None and now - failed_at > FAILED_PEER_GRACE_S and \
                    not stopping:
                self.say(f"an instance failed {FAILED_PEER_GRACE_S:g}s ago; stopping the "
                         f"others")
                stopping = True
                self._stop_backend()
            if self.stop_reason and not stopping:
                stopping = True
                self.say(self.stop_reason)
                if self.store.require(self.name)["secondary_status"] != "Stopping":
                    self.store.transition(self.name, "Stopping", self.stop_reason)
                self._stop_backend()
            if self.spec.checkpoint_uri and now - last_sync > CHECKPOINT_SYNC_S:
                last_sync = now
                try:
                    self._sync_checkpoints()
                except Exception as e:  # the next sync, or the final one, tries again
                    self.say(f"syncing checkpoints failed: {type(e).__name__}: {e}")
            time.sleep(POLL_S)

    def _stop_backend(self) -> None:
        try:
            self.backend.stop()
        except Exception as e:
            self.say(f"stopping the instances failed: {type(e).__name__}: {e}")

    def _close_backend(self) -> None:
        try:
            self.backend.close()
        except Exception as e:
            self.say(f"releasing the backend failed: {type(e).__name__}: {e}")

    def _record(self, lines: list[tuple[int, str]]) -> None:
        metrics = []
        for index, line in lines:
            self.log.write(f"[{self.spec.hosts[index]}] {line}\n" if index >= 0
                           else f"{line}\n")
            metrics += self.log_metrics.parse(line)
        metrics += self.step_metrics.read_new()
        self.store.add_metrics(self.name, self.attempt, metrics)

    def _sync_checkpoints(self) -> None:
        if self.layout.checkpoints.is_dir() and self.spec.checkpoint_uri:
            copied = artifacts.sync_up(self.layout.checkpoints, self.spec.checkpoint_uri)
            if copied:
                self.say(f"synced {copied} checkpoint file(s) to {self.spec.checkpoint_uri}")

    def _finish(self) -> int:
        self._record([])
        self._close_backend()
        results = self._results()
        codes = {i: r.get("exit_code") for i, r in results.items()}
        self.store.update(self.name, exit_codes={self.spec.hosts[i]: c
                                                 for i, c in codes.items()})
        if self.spec.checkpoint_uri:
            try:
                self._sync_checkpoints()
            except Exception as e:
                self.say(f"syncing checkpoints failed: {type(e).__name__}: {e}")
        first = results.get(0, {})
        completed = not self.stop_reason and len(codes) == self.spec.instance_count and \
            all(c == 0 for c in codes.values())
        if first.get("model_uri") and not completed:
            # algo-1 finished its part, but the job did not: it has no model
            artifacts.remove(first.pop("model_uri"))
        self.store.update(self.name, model_uri=first.get("model_uri"),
                          output_uri=first.get("output_uri"))
        if self.stop_reason:
            status = "MaxRuntimeExceeded" if self.stop_reason.startswith("MaxRuntime") \
                else "Stopped"
            if status != "Stopped":
                self.store.update(self.name, failure_reason=self.stop_reason)
            self.say(f"job {self.name}: {status}")
            self.store.transition(self.name, status, self.stop_reason)
            return 3
        if completed:
            self.say(f"job {self.name}: Completed; model {first.get('model_uri')}")
            self.store.transition(self.name, "Completed")
            return 0
        reason = _failure_reason(results, self.spec)
        self.store.update(self.name, failure_reason=reason)
        self.say(f"job {self.name}: Failed\n{reason}")
        self.store.transition(self.name, "Failed", reason.splitlines()[0])
        return 1

    def _results(self) -> dict[int, dict[str, Any]]:
        """Each instance's result.json; an instance that ended without one (killed, lost
        node) gets the exit code the backend saw."""
        seen = self.backend.exit_codes()
        results = {}
        for index in range(self.spec.instance_count):
            path = self.layout.result(index)
            note = self.backend.notes.get(index)
            if path.is_file():
                results[index] = json.loads(path.read_text())
                if note:  # e.g. its node was lost: that, not how it was ended, is the cause
                    results[index].update(exit_code=results[index]["exit_code"] or -1,
                                          failure_reason=note, backend_note=True)
            else:
                code = seen.get(index)
                results[index] = {
                    "exit_code": code if code not in (None, 0) else 1, "no_result": True,
                    "backend_note": bool(note),
                    "failure_reason": note or f"instance {self.spec.hosts[index]} ended "
                                              f"without a result (exit code {code}); see "
                                              f"the job's log"}
        return results


def _failure_reason(results: dict[int, dict[str, Any]], spec: JobSpec) -> str:
    """The failing instance that failed on its own (not because a peer went away)."""
    failed = [(i, r) for i, r in sorted(results.items()) if r.get("exit_code")]
    if not failed:
        return "the job did not finish on every instance"
    # what the backend saw (a lost node), then an instance that failed on its own, then
    # one that saw a peer go away, then one that was stopped without a result
    index, result = min(failed, key=lambda item: (
        not item[1].get("backend_note"), bool(item[1].get("no_result")),
        bool(_PEER_GONE.search(item[1].get("failure_reason") or "")), item[0]))
    return (f"{spec.hosts[index]} exited with {result['exit_code']}: "
            f"{result.get('failure_reason') or 'no error was recorded'}")


def _describe_layout(spec: JobSpec) -> str:
    text = f"{spec.instance_count} x {spec.processes_per_host} = {spec.world_size} processes"
    if spec.config:
        try:
            from modelparallel.config import Config
            from modelparallel.topology import Topology

            text += "; " + Topology.from_config(Config.load(spec.config, environ={}),
                                                spec.world_size).describe()
        except Exception:  # the layout is informative only
            pass
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m modelparallel.jobs.runner")
    p.add_argument("job_dir")
    p.add_argument("--db", required=True, help="the job store")
    args = p.parse_args(argv)
    runner = Runner(JobStore(args.db), JobLayout(Path(args.job_dir)))
    sys.exit(runner.run())


if __name__ == "__main__":
    main()
