"""The worker script of a 2-node matrix run: cases of a batch, results to a file.

Run by ``modelparallel run --nnodes 2 ...`` on each node:
``node_driver.py CASES OUT MAX_GLOO_GROUPS``. Each rank writes ``OUT/rank<R>.pkl`` (case
id -> (result, error, seconds)) after every case. Cases create process groups that live
as long as the process; once a rank holds more than ``MAX_GLOO_GROUPS`` gloo groups the
job stops cleanly after the current case and the caller relaunches it for the rest (as
:class:`~modelparallel.testing.WorkerGroup` restarts its workers).
"""

import datetime
import pickle
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import modelparallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a script: import the package
from modelparallel.testing.workers import gloo_loops
from parity_matrix.space import Case
from parity_matrix.train import RunResult, run_rank


def main() -> None:
    cases = pickle.loads(Path(sys.argv[1]).read_bytes())
    out = Path(sys.argv[2])
    max_gloo_groups = int(sys.argv[3])
    torch.set_num_threads(1)
    # a case that fails on one rank leaves the others in a collective: give up in 60 s
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    results: dict[str, tuple[RunResult | None, str | None, float]] = {}
    for case_dict in cases:
        case = Case.from_dict(case_dict)
        start = time.monotonic()
        try:
            results[case.id] = (run_rank(case_dict), None, time.monotonic() - start)
        except Exception as e:
            text = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            results[case.id] = (None, text, time.monotonic() - start)
        finally:
            modelparallel.reset()
        (out / f"rank{rank}.pkl").write_bytes(pickle.dumps(results))
        # every rank must agree to stop: the largest count decides (and this syncs the ranks)
        loops = torch.tensor([gloo_loops()])
        dist.all_reduce(loops, op=dist.ReduceOp.MAX)
        if loops.item() > max_gloo_groups:
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
