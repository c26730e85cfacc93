"""The ``modelparallel`` command: ``run`` a training script, ``check-config`` a file,
``plan`` a layout, ``report`` on a run, submit and follow training ``jobs``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from typing import NoReturn

from modelparallel.config import ALIASES, Config, ConfigError
from modelparallel.launch.plan_arguments import add_parser as add_plan_parser
from modelparallel.launch.plan_arguments import add_workload_arguments
from modelparallel.topology import Topology
from modelparallel.version import __version__

# torch (seconds to import) only where a command needs it: --help and the parsers do not


class _Parser(argparse.ArgumentParser):
    """argparse with a usage error on one line (and exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _count(least: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``least``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"must be a whole number of at least {least}, "
                                             f"got {text!r}")
        return value

    return parse


def _port(text: str) -> int:
    value = _count(1)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (1 to 65535), got {text!r}")
    return value


def _ranks(text: str) -> str:
    """``--ranks-filter``: comma-separated local ranks, e.g. ``0`` or ``0,3``."""
    parts = text.split(",")
    if not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"must be local ranks separated by commas (e.g. 0 "
                                         f"or 0,3), got {text!r}")
    return ",".join(p.strip() for p in parts)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="modelparallel", description=__doc__)
    p.add_argument("--version", action="version", version=f"modelparallel {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="launch a training script on this node (torchrun)",
                       description="Launch SCRIPT in N processes per node. Single-node jobs "
                                   "bind to 127.0.0.1; give --nnodes/--rdzv-endpoint for "
                                   "several nodes. torchrun's spellings of the options "
                                   "(--nproc_per_node, ...) are accepted too.")
    r.add_argument("--nproc-per-node", "--nproc_per_node", type=_count(1), default=None,
                   help="processes on this node (default: one per GPU, else 1)")
    r.add_argument("--nnodes", type=_count(1), default=1, help="number of nodes (default 1)")
    r.add_argument("--node-rank", "--node_rank", type=_count(0), default=None,
                   help="this node's rank (static rendezvous at --rdzv-endpoint)")
    r.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None,
                   help="HOST:PORT every node can reach")
    r.add_argument("--rdzv-id", "--rdzv_id", default="modelparallel",
                   help="job id shared by all nodes")
    r.add_argument("--master-addr", "--master_addr", default=None,
                   help="torchrun's spelling of the endpoint's HOST (with --master-port)")
    r.add_argument("--master-port", "--master_port", type=_port, default=None,
                   help="torchrun's spelling of the endpoint's PORT (default 29500)")
    r.add_argument("--standalone", action="store_true",
                   help="one node on loopback: the default, accepted for torchrun's sake")
    r.add_argument("--config", default=None,
                   help="JSON or YAML configuration; overrides the script's (MP_CONFIG)")
    r.add_argument("--max-restarts", "--max_restarts", type=_count(0), default=0,
                   help="restart the worker group this many times after a failure")
    r.add_argument("--log-dir", "--log_dir", default=None,
                   help="keep each worker's output here (default: logs/ in the run directory)")
    r.add_argument("--run-dir", "--run_dir", default=None,
                   help="the run directory: config, logs, metrics, TensorBoard events, "
                        "report.html (default: a new dated directory under runs/, or "
                        "$MODELPARALLEL_RUNS_DIR); it belongs to one run")
    r.add_argument("--ranks-filter", "--local-ranks-filter", "--local_ranks_filter",
                   type=_ranks, default=None,
                   help="show only these local ranks' output, e.g. 0 or 0,3 (the run "
                        "directory's logs keep every rank's)")
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
    add_workload_arguments(c, required=False)  # --model ...: also plan the layout

    rp = sub.add_parser("report", help="build a run directory's report.html again",
                        description="Write RUN_DIR/report.html from what the run directory "
                                    "holds (modelparallel run writes it when a run ends).")
    rp.add_argument("run_dir", help="a run directory (runs/...)")

    from modelparallel.jobs.cli import add_parser as add_jobs_parser

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
    from modelparallel.launch.run import load_config_file

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
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from modelparallel.launch.run import RunOptions, run

    try:
        code = run(RunOptions(
            script=args.script, script_args=args.script_args, nproc_per_node=args.nproc_per_node,
            nnodes=args.nnodes, node_rank=args.node_rank, rdzv_endpoint=endpoint(args),
            rdzv_id=args.rdzv_id, config=args.config, max_restarts=args.max_restarts,
            log_dir=args.log_dir, compat=args.compat, run_dir=args.run_dir,
            ranks_filter=args.ranks_filter))
    except ConfigError as e:
        print(f"modelparallel run: {e}", file=sys.stderr)
        code = 2
    except (SignalException, KeyboardInterrupt):  # a second Ctrl-C while the run ended
        print("modelparallel run: interrupted", file=sys.stderr)
        code = 130
    sys.exit(code)


def endpoint(args: argparse.Namespace) -> str | None:
    """The rendezvous endpoint, from --rdzv-endpoint or torchrun's --master-addr and
    --master-port; a combination that cannot work ends the command (exit code 2)."""
    def refuse(message: str) -> NoReturn:
        print(f"modelparallel run: error: {message} (see `modelparallel run --help`)",
              file=sys.stderr)
        sys.exit(2)

    if args.node_rank is not None and args.node_rank >= args.nnodes:
        refuse(f"--node-rank {args.node_rank} is not below --nnodes {args.nnodes} (node "
               f"ranks are 0 to {args.nnodes - 1})")
    if args.standalone and args.nnodes > 1:
        refuse(f"--standalone is one node; --nnodes is {args.nnodes}")
    if args.master_addr is None and args.master_port is None:
        return args.rdzv_endpoint
    if args.rdzv_endpoint is not None:
        refuse("give either --rdzv-endpoint HOST:PORT or --master-addr/--master-port")
    if args.nnodes == 1:  # torchrun's --master-port on one node: where to meet
        return f"{args.master_addr or '127.0.0.1'}:{args.master_port or 29500}"
    if args.master_addr is None:
        refuse("--master-port needs --master-addr (the first node's address)")
    return f"{args.master_addr}:{args.master_port or 29500}"


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
