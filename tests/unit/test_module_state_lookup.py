"""ModuleState: one record per module, read through torch's wrappers as attribute lookup
reads through them."""

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from modelparallel.module_state import KEY, ModuleState, lookup, own_state, state_of


def test_a_record_is_made_once_and_kept_under_one_key():
    m = nn.Linear(2, 2)
    assert own_state(m) is None and lookup(m, "partition") is None
    state_of(m).partition = 1
    assert state_of(m) is own_state(m) and isinstance(m.__dict__[KEY], ModuleState)
    assert lookup(m, "partition") == 1
    assert set(m.__dict__) - set(nn.Linear(2, 2).__dict__) == {KEY}


def test_lookup_reads_through_torchs_wrappers_field_by_field():
    inner = nn.Linear(2, 2)
    state_of(inner).compute_dtype = torch.bfloat16
    wrapped = checkpoint_wrapper(inner)
    compiled = torch.compile(wrapped, backend="eager")
    assert lookup(compiled, "compute_dtype") is torch.bfloat16
    state_of(compiled).partition = 3  # the wrapper's own field; the inner's still found
    assert lookup(compiled, "partition") == 3 and lookup(inner, "partition") is None
    assert lookup(compiled, "compute_dtype") is torch.bfloat16
    assert lookup(nn.Sequential(inner), "compute_dtype") is None  # children are not asked
    assert lookup(inner, "stored_shapes", {}) == {}


def test_a_field_that_does_not_exist_is_an_error():
    with pytest.raises(AttributeError, match="no field 'partiton'"):
        lookup(nn.Linear(1, 1), "partiton")
