"""The parity check itself: differences, and NaN, are reported."""

import math

import torch

from modelparallel.testing.parity import TrainResult, parity_problems


def reference() -> TrainResult:
    return TrainResult([2.0, 1.5], {"w": torch.tensor([1.0, -2.0])})


def test_equal_runs_pass():
    assert parity_problems(reference(), reference()) == []


def test_a_loss_off_by_more_than_rtol_is_reported():
    problems = parity_problems(TrainResult([2.0, 1.6], reference().params), reference())
    assert problems == ["step 1: loss 1.60000000 vs reference 1.50000000 (relative error "
                        "6.67e-02)"]


def test_nan_loss_and_nan_parameters_fail():
    bad = TrainResult([2.0, math.nan], {"w": torch.tensor([1.0, math.nan])})
    problems = parity_problems(bad, reference())
    assert len(problems) == 2
    assert problems[0].startswith("step 1: loss nan")
    assert problems[1].startswith("w: max difference nan")
