"""Tools to prove a parallel layout trains the same model as one process does."""

from modelparallel.testing.parity import (
    TrainResult,
    assert_parity,
    full_parameters,
    local_rows,
    parity_problems,
    token_batches,
    train,
)
from modelparallel.testing.workers import WorkerError, WorkerGroup

__all__ = ["TrainResult", "WorkerError", "WorkerGroup", "assert_parity", "full_parameters",
           "local_rows", "parity_problems", "token_batches", "train"]
