"""``python tests/parity_matrix``: run the parity matrix, print and record it.

    python tests/parity_matrix --full --report docs/parity.md   # everything
    python tests/parity_matrix --ci                             # what CI runs
    python tests/parity_matrix -k qwen3 --list                  # which cases

Exit code 0 when every case passed or was refused as expected, 1 otherwise.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python tests/parity_matrix`: import it as a package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from parity_matrix.cases import ci_cases, full_cases, regression_cases
from parity_matrix.report import summary, write_report
from parity_matrix.run import Outcome, run_cases


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tests/parity_matrix",
                                description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--full", action="store_true", help="every case (the default)")
    which.add_argument("--ci", action="store_true", help="the pairwise subset CI runs")
    which.add_argument("--regression", action="store_true", help="the regression cases only")
    p.add_argument("-k", "--match", default=None, help="only case ids matching this regex")
    p.add_argument("--limit", type=int, default=None, help="at most this many cases")
    p.add_argument("--list", action="store_true", help="print the case ids and exit")
    p.add_argument("--report", default=None, help="write the result table (markdown) here")
    p.add_argument("--quiet", action="store_true", help="print failures and the summary only")
    argv_used = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv_used)

    cases = (ci_cases() if args.ci else regression_cases() if args.regression
             else full_cases())
    if args.match:
        cases = [c for c in cases if re.search(args.match, c.id)]
    cases = cases[:args.limit] if args.limit else cases
    if args.list:
        for c in cases:
            print(c.id)
        print(f"{len(cases)} cases", file=sys.stderr)
        return 0

    start = time.monotonic()
    done: list[Outcome] = []

    def show(o: Outcome) -> None:
        done.append(o)
        if not (args.quiet and o.ok):
            print(f"[{len(done)}/{len(cases)}] {o.status:20} {o.seconds:6.1f}s "
                  f"worst {o.worst:.1e}  {o.case.id}", flush=True)
        if not o.ok:
            print("    " + o.detail[-4000:].replace("\n", "\n    "), flush=True)

    outcomes = run_cases(cases, on_outcome=show)
    wall = time.monotonic() - start
    failed = [o for o in outcomes if not o.ok]
    print(f"{len(outcomes)} cases in {wall / 60:.1f} min: {summary(outcomes)}")
    if args.report:
        command = " ".join(["python tests/parity_matrix",
                            *map(shlex.quote, argv_used)])
        write_report(args.report, outcomes, wall, command=command,
                     full_size=len(full_cases()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
