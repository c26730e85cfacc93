"""Benchmark: start-up time of ``import modelparallel`` and of ``modelparallel --help``.

    python bench/startup.py [--reps 5]

Each command runs ``--reps`` times in a fresh interpreter, alternating; prints the
median wall time of each and, as its last line, the figures measured in this run:
import_modelparallel_minus_torch_s (goal: at most 0.5), api_minus_torch_stack_s (the
whole public API loaded, ``mp.init`` touched, minus torch with the distributed modules a
plain FSDP2 / DTensor / pipelining / DCP script imports; goal: at most 0.5),
help_over_torchrun_help (goal: at most 1).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "import torch": [sys.executable, "-c", "import torch"],
    "import modelparallel": [sys.executable, "-c", "import modelparallel"],
    "import modelparallel; mp.init": [sys.executable, "-c",
                                      "import modelparallel as mp; mp.init"],
    "import torch's distributed stack": [sys.executable, "-c", "import " + ", ".join(
        ["torch"] + [f"torch.distributed.{m}" for m in
                     ("fsdp", "tensor", "pipelining", "checkpoint", "run")])],
    "modelparallel --help": [sys.executable, "-m", "modelparallel", "--help"],
    "torchrun --help": [sys.executable, "-m", "torch.distributed.run", "--help"],  # = torchrun
}


STACK = "import torch's distributed stack"


def timed(argv: list[str]) -> float:
    """Seconds one run of ``argv`` took (its output discarded)."""
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    """Time every command and print the medians and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    reps = parser.parse_args().reps
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(reps):
        for name, argv in COMMANDS.items():
            times[name].append(timed(argv))
    median = {name: statistics.median(t) for name, t in times.items()}
    for name, value in median.items():
        print(f"{name:32} {value:6.2f} s (median of {reps})")
    print(f"import_modelparallel_minus_torch_s="
          f"{median['import modelparallel'] - median['import torch']:.2f} "
          f"api_minus_torch_stack_s="
          f"{median['import modelparallel; mp.init'] - median[STACK]:.2f} "
          f"help_over_torchrun_help="
          f"{median['modelparallel --help'] / median['torchrun --help']:.2f}")


if __name__ == "__main__":
    main()
