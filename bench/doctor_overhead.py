"""Benchmark: what the hang and divergence doctor costs (``modelparallel run`` with it on,
the default, against ``MP_DOCTOR=0``).

    python bench/doctor_overhead.py [--reps 3] [--calls 3000] [--steps 30]

The same 2-rank script runs under ``modelparallel run --nproc-per-node 2`` with the
doctor on and off, alternating, ``--reps`` times each. In each run it times, after a
warm-up:

- ``--calls`` all-reduces of 4 floats from Python (``torch.distributed.all_reduce``,
  what the doctor wraps: the worst case, a call that does almost nothing);
- ``--steps`` training steps of a small GPT (d_model 256, 2 layers) under
  ``mp.shard`` (FSDP2: its collectives are issued from C++, so only Python-level calls
  pass through the doctor).

Prints the medians and, as its last line, the ratios measured in this run:
doctor_allreduce_on_over_off and doctor_step_on_over_off (goal: close to 1), and the
added time per wrapped call in microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent('''
    import json, sys, time
    import torch, torch.distributed as dist
    import modelparallel as mp
    from modelparallel.models import GPT, GPTConfig
    from modelparallel.models.gpt import lm_loss

    calls, steps = int(sys.argv[1]), int(sys.argv[2])
    mp.init({"hybrid_shard_degree": 2})
    x = torch.ones(4)
    for _ in range(200):
        dist.all_reduce(x)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(x)
    per_call = (time.perf_counter() - start) / calls
    torch.manual_seed(0)
    model = mp.shard(GPT(GPTConfig(vocab_size=512, max_seq_len=64, d_model=256, n_layers=2,
                                   n_heads=4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 512, (4, 65))
    times = []
    for step in range(steps + 3):
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        lm_loss(model(ids[:, :-1]), ids[:, 1:]).backward()
        opt.step()
        if step >= 3:
            times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"per_call": per_call,
                                      "step": sorted(times)[len(times) // 2]}), flush=True)
''')


def one_run(script: Path, doctor: bool, calls: int, steps: int) -> dict:
    env = {**os.environ, "MP_DOCTOR": "1" if doctor else "0",
           "MODELPARALLEL_RUNS_DIR": str(script.parent / "runs")}
    out = subprocess.run([sys.executable, "-m", "modelparallel", "run", "--nproc-per-node",
                          "2", str(script), str(calls), str(steps)], capture_output=True,
                         text=True, env=env, check=True).stdout
    line = next(x for x in out.splitlines() if "RESULT " in x)
    return json.loads(line.split("RESULT ", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    results: dict[bool, list[dict]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "doctor_bench.py"
        script.write_text(SCRIPT)
        for rep in range(args.reps):
            for doctor in ((True, False) if rep % 2 == 0 else (False, True)):
                results[doctor].append(one_run(script, doctor, args.calls, args.steps))
    med = {d: {k: statistics.median(r[k] for r in results[d]) for k in ("per_call", "step")}
           for d in results}
    for d, label in ((True, "doctor on "), (False, "doctor off")):
        print(f"{label}: all_reduce {med[d]['per_call'] * 1e6:8.1f} us/call, "
              f"step {med[d]['step'] * 1e3:8.2f} ms")
    print(f"doctor_allreduce_on_over_off={med[True]['per_call'] / med[False]['per_call']:.3f} "
          f"doctor_step_on_over_off={med[True]['step'] / med[False]['step']:.3f} "
          f"added_us_per_call={(med[True]['per_call'] - med[False]['per_call']) * 1e6:.1f}")


if __name__ == "__main__":
    main()
