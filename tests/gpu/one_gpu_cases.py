"""The parity matrix's one-process cases on this machine's first CUDA GPU (or its CPU).

Each case trains in this process (``mp.init`` makes the one-process default group,
NCCL for CUDA tensors) and is judged against the matrix's one-process CPU references,
as ``python tests/parity_matrix`` judges its cases. Prints one JSON line per
case; exits 1 if any fails. Run by ``tests/gpu/test_one_gpu.py`` (skipped without a GPU)
or directly: ``python tests/gpu/one_gpu_cases.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import sys
import time
from pathlib import Path

import torch

import modelparallel as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # as a script: tests/ too
from parity_matrix import train
from parity_matrix.run import judge
from parity_matrix.space import PATHS, Case, Layout

MODELS = ("gpt", "vit", "tied", "llama")  # our own, an image model, tied weights, HF


def cases() -> list[Case]:
    layout = Layout(1, 1, 1, 0)
    models = [m for m in MODELS if m != "llama" or importlib.util.find_spec("transformers")]
    return [Case(layout, path, model, precision, checkpointing=model == "gpt")
            for path, model, precision in itertools.product(PATHS, models,
                                                              ("fp32", "bf16", "fp16"))]


def run(case: Case, exact: bool = False) -> list[train.RunResult]:
    try:
        return [train.run_rank(dataclasses.asdict(case), exact=exact)]
    finally:
        mp.reset()


def main() -> int:
    print(f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, "
          f"torch {torch.__version__}", flush=True)
    failed = 0
    for case in cases():
        start = time.monotonic()
        try:
            results, error = run(case), None
        except Exception as e:  # judged like a worker's error
            results, error = None, f"{type(e).__name__}: {e}"
        outcome = judge(case, results, error, time.monotonic() - start,
                        lambda case=case: run(case, exact=True))
        failed += not outcome.ok
        print(json.dumps({"case": case.id, "status": outcome.status,
                          "worst": outcome.worst, "detail": outcome.detail[:600],
                          "seconds": round(outcome.seconds, 1)}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
