"""The command-line arguments of ``modelparallel plan`` and ``check-config --model``.

Apart from the planner (which imports torch), so that ``modelparallel --help`` and the
other commands' parsers start without it; ``tests/unit/test_startup.py`` checks that the
names offered here are the planner's.
"""

from __future__ import annotations

import argparse
from typing import Any

OPTIMIZERS = ("adamw", "adam", "sgd")  # modelparallel.plan.workload.OPTIMIZERS
DEVICE_PROFILES = ("a100", "h100", "h200")  # modelparallel.plan.device_model.PROFILES


def add_workload_arguments(p: argparse.ArgumentParser, *, required: bool) -> None:
    """The arguments that say what is trained (shared with ``check-config``)."""
    p.add_argument("--model", required=required, metavar="FILE.py:FUNCTION",
                   help="FUNCTION() returns the single-device model; FILE is imported as a "
                        "training script would be (its TP plan registrations run)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="rows each rank's data loader yields per step (with prescaled_batch "
                        "false a tensor-parallel group concatenates its ranks' batches)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per row")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="checkpoint the model's repeated blocks")
    p.add_argument("--api", choices=("v1", "v2"), default="v1",
                   help="v1: DistributedModel + @step (any layout); v2: transform + shard")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan", help="predict each rank's memory, communication and step time before launch",
        description="Simulate one training step of every rank on fake tensors and a fake "
                    "process group (nothing is allocated or sent) and report per rank the "
                    "peak of allocated tensor memory and its parts, the bytes each group's "
                    "collectives move, and an estimated step time (docs/planner.md).")
    add_workload_arguments(p, required=True)
    p.add_argument("--config", default=None, help="JSON or YAML configuration (the layout)")
    p.add_argument("--world-size", type=int, required=True, help="processes in the job")
    p.add_argument("--memory-per-device", default=None, metavar="BYTES",
                   help="search every layout of the world size and rank those whose peak "
                        "fits in BYTES (suffixes K, M, G, T: powers of 1024)")
    p.add_argument("--device-profile", choices=DEVICE_PROFILES, default=None,
                   help="estimate the step time with a GPU's datasheet figures instead of "
                        "calibrating this machine")
    p.add_argument("--json", action="store_true", help="print one JSON object")
