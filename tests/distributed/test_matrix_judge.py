"""The parity matrix's judge fails known bugs, in every precision (expert parallelism's
in float64, the precision its cases train in).

Each bug of ``tests/parity_matrix/mutations.py`` is injected into a real run (2 gloo ranks,
never into the one-process reference) and the case must end ``FAIL`` in fp32, bf16
and fp16, for the reason the bug causes; the same cases without the bug pass. Dropout
masks redrawn by recomputation are caught by tests/distributed/test_randomness.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from parity_matrix import run
from parity_matrix.space import Case, Layout

PRECISIONS = ("fp32", "bf16", "fp16")
CASES = {  # mutation: (a case it applies to, what the judge must say)
    "zero_grad": (Case(Layout(2, 1, 1, 0), "shard", "gpt"), "q_proj.weight"),
    "skip_allreduce": (Case(Layout(2, 1, 1, 1), "ddp", "gpt"), "drifted apart"),
    "double_loss": (Case(Layout(2, 1, 2, 0), "v1", "gpt"), "from the float64 answer"),
    "unused_grad": (Case(Layout(2, 1, 1, 1), "v1", "gpt", ddp=True, unused=True),
                    "in the run that one process does not have"),
}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("mutation", sorted(CASES))
def test_the_judge_fails_an_injected_bug(workers, mutation, precision):
    case, says = CASES[mutation]
    case = dataclasses.replace(case, precision=precision, mutation=mutation)
    outcome = run.run_on_group(workers(2), case)
    assert outcome.status == "FAIL", f"{case.id}: the judge passed a bug"
    assert outcome.judged and says in outcome.detail, outcome.detail


@pytest.mark.parametrize("mutation", sorted(CASES))
def test_the_same_cases_without_the_bug_pass(workers, mutation):
    case = dataclasses.replace(CASES[mutation][0], precision="bf16")
    outcome = run.run_on_group(workers(2), case)
    assert outcome.ok and outcome.judged, f"{case.id}: {outcome.detail}"


# expert parallelism: its own mutation, in the precision its cases train in (float64)
EXPERT_CASE = Case(Layout(2, 1, 1, 0, ep=2), "shard", "mixtral", precision="fp64")


def test_the_judge_fails_expert_gradients_divided_over_their_holders_only(workers):
    case = dataclasses.replace(EXPERT_CASE, mutation="expert_grads_over_holders")
    outcome = run.run_on_group(workers(2), case)
    assert outcome.status == "FAIL", f"{case.id}: the judge passed a bug"
    assert outcome.judged and "mlp.experts.down_proj" in outcome.detail, outcome.detail


def test_the_expert_case_without_the_bug_passes(workers):
    outcome = run.run_on_group(workers(2), EXPERT_CASE)
    assert outcome.ok and outcome.judged, f"{EXPERT_CASE.id}: {outcome.detail}"
