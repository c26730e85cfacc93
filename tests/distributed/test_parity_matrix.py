"""The parity matrix's CI subset: every pair of axis values, and the regression cases.

Each case trains in real gloo processes through its API path and is judged against a
one-process reference (losses every step; every parameter and optimizer-state tensor,
gathered on every rank; replicas bitwise equal), or must be refused with its message.
The full matrix is ``python tests/parity_matrix --full`` (docs/testing.md).
"""

import pytest

from parity_matrix import run
from parity_matrix.cases import ci_cases

CASES = ci_cases()
SINGLE = [c for c in CASES if c.layout.nodes == 1]
MULTI = [c for c in CASES if c.layout.nodes > 1]


def _check(outcome: run.Outcome) -> None:
    assert outcome.ok, f"{outcome.case.id} ({outcome.case.note or 'generated'}):\n" \
                       f"{outcome.detail}"


@pytest.mark.parametrize("case", sorted(SINGLE, key=lambda c: (c.layout.processes, c.id)),
                         ids=lambda c: c.id)
def test_single_node_case(workers, case):
    _check(run.run_on_group(workers(case.layout.processes), case))


@pytest.fixture(scope="module")
def two_node_outcomes():
    # the job's own limit, inside the test's: a stalled job reports its agents' logs
    return {o.case.id: o for o in run.run_multinode(MULTI, timeout_s=1200)}


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("case", MULTI, ids=lambda c: c.id)
def test_two_node_case(two_node_outcomes, case):
    _check(two_node_outcomes[case.id])


def test_the_subset_covers_every_pair_and_the_regressions():
    from parity_matrix.cases import _pairs, full_cases, regression_cases

    everything = full_cases()
    needed = set().union(*(_pairs(c) for c in everything))
    covered = set().union(*(_pairs(c) for c in CASES))
    assert needed <= covered
    assert {c.id for c in regression_cases()} <= {c.id for c in CASES}
