"""The ``modelparallel`` command: ``run`` a training script, ``check-config`` a file,
``plan`` a layout, ``report`` on a run, submit and follow training ``jobs``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable

from modelparallel.config import ALIASES, Config, ConfigError
from modelparallel.launch.run import RunOptions, load_config_file, run
from modelparallel.topology import Topology


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="modelparallel", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="launch a training script on this node (torchrun)",
                       description="Launch SCRIPT in N processes per node. Single-node jobs "
                                   "bind to 127.0.0.1; give --nnodes/--rdzv-endpoint for "
                                   "several nodes.")
    r.add_argument("--nproc-per-node", type=int, default=None,
                   help="processes on this node (default: one per GPU, else 1)")
    r.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    r.add_argument("--node-rank", type=int, default=None,
                   help="this node's rank (static rendezvous at --rdzv-endpoint)")
    r.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT every node can reach")
    r.add_argument("--rdzv-id", default="modelparallel", help="job id shared by all nodes")
    r.add_argument("--config", default=None,
                   help="JSON or YAML configuration; overrides the script's (MP_CONFIG)")
    r.add_argument("--max-restarts", type=int, default=0,
                   help="restart the worker group this many times after a failure")
    r.add_argument("--log-dir", default=None, help="keep each worker's output here (default: "
                                                   "logs/ in the run directory)")
    r.add_argument("--run-dir", default=None,
                   help="the run directory: config, logs, metrics, TensorBoard events, "
                        "report.html (default: a new dated directory under runs/, or "
                        "$MODELPARALLEL_RUNS_DIR)")
    r.add_argument("--compat", choices=["sagemaker"], default=None,
                   help="run the script with its SageMaker imports unchanged: "
                        "smdistributed.modelparallel.torch, torch.sagemaker and "
                        "smdistributed.dataparallel resolve to modelparallel")
    r.add_argument("script", help="the training script")
    r.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")

    c = sub.add_parser("check-config", help="validate a configuration file without starting "
                                            "anything")
    c.add_argument("file", nargs="?", help="JSON or YAML configuration")
    c.add_argument("--world-size", type=int, default=None,
                   help="also check the degrees against this many processes")
    c.add_argument("--list", action="store_true", help="list every key with its default")
    from modelparallel.plan.cli import add_workload_arguments

    add_workload_arguments(c, required=False)  # --model ...: also plan the layout

    rp = sub.add_parser("report", help="build a run directory's report.html again",
                        description="Write RUN_DIR/report.html from what the run directory "
                                    "holds (modelparallel run writes it when a run ends).")
    rp.add_argument("run_dir", help="a run directory (runs/...)")

    from modelparallel.jobs.cli import add_parser as add_jobs_parser
    from modelparallel.plan.cli import add_parser as add_plan_parser

    add_jobs_parser(sub)
    add_plan_parser(sub)
    return p


def check_config(file: str | None, world_size: int | None, list_keys: bool,
                 plan: Callable[[], str | None] | None = None) -> int:
    """``modelparallel check-config``: OK (and the keys) only when every check passed;
    ``plan`` (for ``--model``) returns the plan's text, or None after printing why not."""
    if list_keys:
        print(describe_keys())
        if file is None:
            return 0
    if file is None:
        print("modelparallel check-config: give a FILE or --list", file=sys.stderr)
        return 2
    try:
        explicit, config = load_config_file(file)
        topology = Topology.from_config(config, world_size) if world_size is not None else None
    except ConfigError as e:
        print(f"{file}: {e}", file=sys.stderr)
        return 1
    planned = plan() if plan is not None else ""
    if planned is None:
        return 2
    print(f"{file}: OK ({len(explicit)} keys set)")
    if topology is not None:
        print(f"layout: {topology.describe()}")
    print(json.dumps({k: getattr(config, k) for k in explicit}, indent=2))
    if planned:
        print(planned)
    return 0


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.command == "check-config":
        from modelparallel.plan.cli import plan_for_check_config

        sys.exit(check_config(args.file, args.world_size, args.list,
                              None if args.model is None else
                              lambda: plan_for_check_config(args)))
    if args.command == "report":
        sys.exit(report(args.run_dir))
    if args.command == "plan":
        from modelparallel.plan.cli import main as plan_main

        sys.exit(plan_main(args))
    if args.command == "jobs":
        from modelparallel.jobs.cli import main as jobs_main

        sys.exit(jobs_main(args))
    try:
        code = run(RunOptions(
            script=args.script, script_args=args.script_args, nproc_per_node=args.nproc_per_node,
            nnodes=args.nnodes, node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
            rdzv_id=args.rdzv_id, config=args.config, max_restarts=args.max_restarts,
            log_dir=args.log_dir, compat=args.compat, run_dir=args.run_dir))
    except ConfigError as e:
        print(f"modelparallel run: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)


def report(run_dir: str) -> int:
    """``modelparallel report RUN_DIR``: write its report.html again."""
    from modelparallel.observe.report import write_report

    try:
        path = write_report(run_dir)
    except FileNotFoundError as e:
        print(f"modelparallel report: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def describe_keys() -> str:
    """A table of every key with its default and meaning (for ``check-config --list``),
    one line per key; keys without effect and refused keys say so, and why."""
    rows = []
    for f in dataclasses.fields(Config):
        alias = [a for a, n in ALIASES.items() if n == f.name]
        name = f.name + (f" (alias: {', '.join(alias)})" if alias else "")
        row = f"{name:45} default={f.default!r:14} {f.metadata['doc']}"
        if f.metadata["no_effect"]:
            row += f" [no effect here: {f.metadata['no_effect']}]"
        elif f.metadata["not_built"]:
            row += f" [only the default is accepted: {f.metadata['not_built']}]"
        rows.append(row)
    return "\n".join(rows)
