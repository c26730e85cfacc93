"""The parity matrix's judge fails known bugs, in every precision.

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
