"""The one-process parity cases on a CUDA GPU; skipped where there is none."""

import json
import os
import subprocess
import sys

import pytest
import torch

from parity_matrix.run import OK_STATUSES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (run on a GPU machine)")


def test_one_process_cases_on_a_gpu_match_the_cpu_references():
    script = os.path.join(os.path.dirname(__file__), "one_gpu_cases.py")
    done = subprocess.run([sys.executable, script], capture_output=True, text=True,
                          timeout=1800)
    outcomes = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert outcomes, done.stderr[-3000:]
    bad = [o for o in outcomes if o["status"] not in OK_STATUSES]
    assert not bad, json.dumps(bad, indent=1)
    assert done.returncode == 0, done.stderr[-3000:]
