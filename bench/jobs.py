"""Benchmark: what running a script as a training job costs over running it directly.

    python bench/jobs.py [--reps 3] [--seconds 5]

The same script (a gloo process group, an all-reduce, ``--seconds`` of work, one
all-reduce more) runs 4 processes three ways, each ``--reps`` times, timed from the
command's start to its end:

- ``modelparallel run --nproc-per-node 4`` (torchrun, one node): the reference;
- a job on the local backend, 1 instance x 4 processes, submitted with
  ``modelparallel jobs submit`` and waited for (spec checks, code snapshot, runner
  process, job store, log streaming, artifact packing);
- the same job as 2 instances x 2 processes (two torchrun agents, a c10d rendezvous
  between them, as two nodes).

Prints the median of each and, as its last line, the ratios measured in this run:
job_1x4_over_run and job_2x2_over_run (goal: close to 1, the fixed cost of a job
being a few seconds against a training run's minutes or hours), and the fixed
overhead in seconds of each kind of job.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

SCRIPT = textwrap.dedent('''
    import argparse, time
    import torch, torch.distributed as dist
    p = argparse.ArgumentParser(); p.add_argument("--seconds", type=float); a = p.parse_args()
    dist.init_process_group("gloo")
    t = torch.ones(1); dist.all_reduce(t)
    time.sleep(a.seconds)
    dist.all_reduce(t)
    dist.destroy_process_group()
''')


def timed(argv: list[str], env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0)
    args = p.parse_args()
    cli = [sys.executable, "-m", "modelparallel"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "work.py").write_text(SCRIPT)
        for name, (instances, procs) in {"1x4": (1, 4), "2x2": (2, 2)}.items():
            (root / f"job{name}.yaml").write_text(
                f"entry_point: work.py\ninstance_count: {instances}\n"
                f"processes_per_host: {procs}\nhyperparameters: {{seconds: {args.seconds}}}\n")
        runs = {"run": [], "job_1x4": [], "job_2x2": []}
        for rep in range(args.reps):  # interleaved, so drifts in load hit all alike
            runs["run"].append(timed([*cli, "run", "--nproc-per-node", "4",
                                      str(root / "work.py"), "--seconds", str(args.seconds)]))
            for name in ("1x4", "2x2"):
                runs[f"job_{name}"].append(timed(
                    [*cli, "jobs", "--jobs-dir", str(root / "jobs"), "submit", "--quiet",
                     "--name", f"bench-{name}-{rep}", str(root / f"job{name}.yaml")]))
    medians = {k: statistics.median(v) for k, v in runs.items()}
    for k, v in runs.items():
        print(f"{k:8s} median {medians[k]:6.2f} s  ({', '.join(f'{t:.2f}' for t in v)})")
    ratios = {"job_1x4_over_run": medians["job_1x4"] / medians["run"],
              "job_2x2_over_run": medians["job_2x2"] / medians["run"],
              "job_1x4_overhead_s": medians["job_1x4"] - medians["run"],
              "job_2x2_overhead_s": medians["job_2x2"] - medians["run"]}
    print("RATIOS " + " ".join(f"{k}={v:.4f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
