"""How the parity matrix judges a case's tensors: as accurate as one process, measured
against the float64 answer; and the float64 rerun that tells round-off from a wrong result."""

import torch

from parity_matrix.compare import NOISE_MARGIN, exact_problems, problems
from parity_matrix.space import Case, Layout
from parity_matrix.train import RunResult

CASE = Case(Layout(4, 1, 2, 0), "shard", "gpt", "fp32")
ANSWER = torch.linspace(-1.0, 1.0, 16, dtype=torch.float64)
NOISE = torch.linspace(1.0, -1.0, 16, dtype=torch.float64) * 1e-4  # one process's round-off


def result(w: torch.Tensor, losses: list[float] | None = None) -> RunResult:
    return RunResult(losses or [1.0, 0.9], {"w": w.float()}, {"state.w.momentum_buffer": w.float()})


def judge(run: torch.Tensor, ranks: int = 2, case: Case = CASE,
          noise: torch.Tensor = NOISE):
    whole, sliced = result(ANSWER + noise), result(ANSWER - noise / 2)
    exact = RunResult(whole.losses, {"w": ANSWER}, {"state.w.momentum_buffer": ANSWER})
    return problems(case, [result(run)] * ranks, whole, sliced, exact)


def test_a_run_as_accurate_as_one_process_passes_though_it_errs_the_other_way():
    # 3.5e-4 from the whole-batch reference, more than 3x any distance among the one-process
    # runs and the answer (1.5e-4), but only 2.5x as far from the answer as one process
    found, roundoff, _ = judge(ANSWER - 2.5 * NOISE)
    assert found == [] and roundoff == []


def test_a_run_further_from_the_answer_than_round_off_allows_is_set_apart():
    found, roundoff, _ = judge(ANSWER + 2 * NOISE_MARGIN * NOISE)
    assert found == []
    assert len(roundoff) == 2  # the parameter and its momentum
    assert "from the float64 answer, one process 1.000e-04" in roundoff[0]


def test_ranks_that_disagree_are_a_problem_no_rerun_clears():
    whole, sliced = result(ANSWER + NOISE), result(ANSWER - NOISE)
    other = result(ANSWER + NOISE / 3)
    found, _, _ = problems(CASE, [result(ANSWER), other], whole, sliced, result(ANSWER))
    assert any("rank 1" in f for f in found)


def test_the_float64_rerun_must_match_the_answer():
    exact = RunResult([1.0], {"w": ANSWER, "bias": torch.zeros(4, dtype=torch.float64)},
                      {"state.w.momentum_buffer": ANSWER})
    same = RunResult([1.0], {"w": ANSWER.clone(), "bias": torch.full((4,), 1e-20,
                                                                     dtype=torch.float64)},
                     {"state.w.momentum_buffer": ANSWER.clone()})
    # a zero-gradient bias holds only round-off: below one float64 unit of the largest
    # parameter it is noise
    assert exact_problems([same, same], exact) == []
    wrong = RunResult([1.0], {"w": ANSWER * (1 + 1e-8), "bias": exact.params["bias"]},
                      exact.optimizer)
    found = exact_problems([same, wrong], exact)
    assert len(found) == 1 and found[0].startswith("float64 rerun, rank 1: parameter w")


def _judge_half(offset: float):
    # bf16: one process 5e-2 from the answer (past 10 u = 3.9e-2, so 3x it is the bound)
    return judge(ANSWER + offset * 500 * NOISE, case=Case(Layout(4, 1, 2, 0), "shard", "gpt",
                                                         "bf16"), noise=500 * NOISE)


def test_half_precision_past_one_process_is_set_apart_for_the_float64_rerun():
    found, roundoff, _ = _judge_half(2.5)
    assert found == [] and roundoff == []
    found, roundoff, _ = _judge_half(5.0)  # 5x one process: round-off of more pieces
    assert found == [] and len(roundoff) == 2


def test_half_precision_far_past_one_process_fails_whatever_the_rerun_says():
    # the float64 rerun cannot see a wrong cast or loss scale: past the cap no rerun clears it
    found, roundoff, _ = _judge_half(12.0)
    assert roundoff == [] and len(found) == 2
    assert "past 10x one process, more than bf16 round-off does" in found[0]


def test_half_precision_bounds_are_on_what_training_changed():
    # a bf16 parameter of value ~1 that training moved by ~1e-3: a run that never moved it
    # (its gradient zeroed) is 1e-3 off, far below one bf16 unit of the value (4e-3), but
    # the whole of its change
    bf16 = Case(Layout(2, 1, 1, 0), "shard", "gpt", "bf16")
    init = torch.ones(16)
    moved = init + 1e-3 * torch.linspace(-1.0, 1.0, 16)
    state = {"state.w.momentum_buffer": moved - init}
    ref = RunResult([1.0], {"w": moved}, state, initial={"w": init})
    exact = RunResult([1.0], {"w": moved.double()}, state)
    frozen = RunResult([1.0], {"w": init.clone()}, state)
    found, roundoff, _ = problems(bf16, [frozen, frozen], ref, ref, exact)
    assert any("parameter w" in f for f in found + roundoff)
    found, roundoff, _ = problems(bf16, [ref, ref], ref, ref, exact)
    assert found == [] and roundoff == []


def test_optimizer_state_one_process_does_not_have_is_a_problem():
    extra = result(ANSWER.float())
    extra.optimizer["state.unused.momentum_buffer"] = torch.zeros(4)
    found, _, _ = problems(CASE, [extra, extra], result(ANSWER), None, None)
    assert any("in the run that one process does not have" in f for f in found)
