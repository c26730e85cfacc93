"""``modelparallel jobs``: submit, list, describe, logs, stop.

Exit codes: 0 success (submit: the job completed), 1 the job failed (or the command
could not do its work), 2 invalid job file or arguments, 3 the job was stopped, 4 no
such job / a job of that name is running, 130 interrupted (the job keeps running).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

from modelparallel.jobs.estimator import (
    Estimator,
    TrainingJob,
    check_runner,
    follow_log,
    stop_job,
)
from modelparallel.jobs.layout import JobLayout
from modelparallel.jobs.spec import JobError, read_job_file
from modelparallel.jobs.store import TERMINAL, JobExists, JobStore, default_jobs_dir

EXIT = {"Completed": 0, "Failed": 1, "Stopped": 3}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("jobs", help="training jobs: submit, list, describe, logs, stop",
                       description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--jobs-dir", default=None,
                   help="job store and job directories (default $MODELPARALLEL_JOBS_DIR or "
                        "~/.local/share/modelparallel/jobs)")
    jobs = p.add_subparsers(dest="jobs_command", required=True)
    s = jobs.add_parser("submit", help="start a job described by a YAML file")
    s.add_argument("file", help="job file: the Estimator's fields, plus inputs")
    s.add_argument("--name", default=None, help="job name (default: the file's job_name, "
                                                "else the entry point and a timestamp)")
    s.add_argument("--detach", action="store_true", help="return once the job started")
    s.add_argument("--dry-run", action="store_true",
                   help="check the job and print what the backend would run")
    s.add_argument("--quiet", action="store_true", help="do not print the job's log")
    ls = jobs.add_parser("list", help="jobs, newest first")
    ls.add_argument("--status", default=None, help="only jobs with this status")
    ls.add_argument("--json", action="store_true")
    d = jobs.add_parser("describe", help="one job's record")
    d.add_argument("name")
    d.add_argument("--json", action="store_true")
    lg = jobs.add_parser("logs", help="a job's log")
    lg.add_argument("name")
    lg.add_argument("--follow", "-f", action="store_true", help="until the job ends")
    st = jobs.add_parser("stop", help="stop a running job")
    st.add_argument("name")
    st.add_argument("--wait", action="store_true", help="until it has stopped")


def main(args: argparse.Namespace) -> int:
    jobs_dir = Path(args.jobs_dir).resolve() if args.jobs_dir else default_jobs_dir()
    try:
        return _COMMANDS[args.jobs_command](args, jobs_dir)
    except JobError as e:
        print(f"modelparallel jobs {args.jobs_command}: {e}", file=sys.stderr)
        return 2
    except LookupError as e:
        print(f"modelparallel jobs {args.jobs_command}: {e.args[0]}; `modelparallel jobs "
              f"list` shows the jobs", file=sys.stderr)
        return 4
    except JobExists as e:
        print(f"modelparallel jobs {args.jobs_command}: {e}", file=sys.stderr)
        return 4
    except RuntimeError as e:  # e.g. stopping a job run from another host
        print(f"modelparallel jobs {args.jobs_command}: {e}", file=sys.stderr)
        return 1


def _submit(args: argparse.Namespace, jobs_dir: Path) -> int:
    fields = read_job_file(args.file)
    name = args.name or fields.pop("job_name", None)
    fields.pop("job_name", None)
    inputs = fields.pop("inputs", None)
    est = Estimator(**fields, job_name=name, jobs_dir=jobs_dir)
    if args.dry_run:
        print(est.render(inputs))
        return 0
    job = est.fit(inputs, wait=False)
    print(f"submitted job {job.name} ({jobs_dir})", file=sys.stderr, flush=True)
    if args.detach:
        print(job.name)
        return 0
    try:
        status = job.wait(logs=not args.quiet)
    except KeyboardInterrupt:
        print(f"\njob {job.name} keeps running; `modelparallel jobs stop {job.name}` "
              f"stops it", file=sys.stderr)
        return 130
    record = job.describe()
    print(f"job {job.name}: {record['secondary_status']}"
          + (f"\n{record['failure_reason']}" if record["failure_reason"] else "")
          + (f"\nmodel: {record['model_uri']}" if record["model_uri"] else ""),
          file=sys.stderr)
    return EXIT.get(status, 1)


def _list(args: argparse.Namespace, jobs_dir: Path) -> int:
    store = JobStore(jobs_dir / "jobs.db")
    records = [check_runner(store, r["name"]) for r in store.list(args.status)]
    if args.json:
        print(json.dumps([_summary(r) for r in records], indent=2))
        return 0
    rows = [("NAME", "STATUS", "BACKEND", "INSTANCES", "CREATED", "DURATION", "RUN DIR")]
    for r in records:
        rows.append((r["name"], r["secondary_status"], r["backend"],
                     f"{r['instance_count']}x{r['processes_per_host']}",
                     _time(r["created_at"]), _duration(r), _run_dir(r)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def _describe(args: argparse.Namespace, jobs_dir: Path) -> int:
    job = TrainingJob(args.name, jobs_dir)
    record = job.describe()
    record["metrics"] = _last_metrics(job)
    if args.json:
        print(json.dumps(record, indent=2, default=str))
        return 0
    spec = record["spec"]
    print(f"name:            {record['name']}")
    print(f"status:          {record['status']} ({record['secondary_status']}), attempt "
          f"{record['attempt']}")
    print(f"backend:         {record['backend']}")
    print(f"entry point:     {spec['entry_point']}"
          + (f" in {spec['source_dir']}" if spec.get("source_dir") else ""))
    print(f"layout:          {record['layout'] or _layout(record)}")
    if spec.get("config"):
        print(f"configuration:   {json.dumps(spec['config'])}")
    print(f"hyperparameters: {json.dumps(record['hyperparameters'], sort_keys=True)}")
    for name, channel in spec.get("inputs", {}).items():
        print(f"input {name + ':':<10} {channel['uri']} ({channel['input_mode']}, "
              f"{channel['distribution']})")
    print(f"created:         {_time(record['created_at'])}  duration {_duration(record)}")
    if record["exit_codes"]:
        print(f"exit codes:      {json.dumps(record['exit_codes'])}")
    for key, label in (("model_uri", "model"), ("output_uri", "output"),
                       ("checkpoint_uri", "checkpoints")):
        if record[key]:
            print(f"{label + ':':<17}{record[key]}")
    print(f"job directory:   {record['job_dir']}")
    print(f"run directory:   {_run_dir(record)} (report.html: `modelparallel report DIR` "
          f"builds it again)")
    if record["failure_reason"]:
        print("failure reason:\n  " + record["failure_reason"].replace("\n", "\n  "))
    if record["metrics"]:
        print("metrics (last value):")
        for metric, value in record["metrics"].items():
            print(f"  {metric}: {value:g}")
    print("transitions:")
    for t in record["transitions"]:
        print(f"  {_time(t['at'])}  attempt {t['attempt']}  {t['status']}"
              + (f"  ({t['message'].splitlines()[0]})" if t["message"] else ""))
    return 0


def _logs(args: argparse.Namespace, jobs_dir: Path) -> int:
    job = TrainingJob(args.name, jobs_dir)
    for line in follow_log(job, from_start=True, follow=args.follow):
        sys.stdout.write(line)
        sys.stdout.flush()
    return 0


def _stop(args: argparse.Namespace, jobs_dir: Path) -> int:
    job = TrainingJob(args.name, jobs_dir)
    status = stop_job(job.store, job.name)
    if status in TERMINAL:
        print(f"job {job.name} has already ended: {status}", file=sys.stderr)
        return 0
    print(f"stopping job {job.name}", file=sys.stderr)
    if args.wait:
        status = job.wait(logs=False)
        print(f"job {job.name}: {status}", file=sys.stderr)
    return 0


_COMMANDS = {"submit": _submit, "list": _list, "describe": _describe, "logs": _logs,
             "stop": _stop}


def _last_metrics(job: TrainingJob) -> dict[str, float]:
    return {name: values[-1] for name, values in job.metrics.items()}


def _summary(r: dict[str, Any]) -> dict[str, Any]:
    return {**{k: r[k] for k in ("name", "status", "secondary_status", "backend",
                                 "instance_count", "processes_per_host", "created_at",
                                 "ended_at", "model_uri", "failure_reason")},
            "run_dir": _run_dir(r)}


def _run_dir(r: dict[str, Any]) -> str:
    """The job's run directory: its first instance's (logs, metrics, report.html)."""
    return str(JobLayout(r["job_dir"]).run_dir(0))


def _layout(r: dict[str, Any]) -> str:
    return f"{r['instance_count']} x {r['processes_per_host']} processes"


def _time(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _duration(r: dict[str, Any]) -> str:
    import time

    start = r["created_at"]
    end = r["ended_at"] or (time.time() if r["status"] not in TERMINAL else start)
    seconds = int(end - start)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
