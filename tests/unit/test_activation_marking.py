"""mp.set_activation_checkpointing: marking, and the strategies it refuses."""

import pytest
from torch import nn

import modelparallel as mp
from modelparallel.parallel.activation import apply_activation_checkpointing


def test_unsupported_strategy_names_the_supported_one():
    with pytest.raises(ValueError) as err:
        mp.set_activation_checkpointing(nn.Linear(2, 2), strategy="group_2")
    assert str(err.value).startswith("strategy='group_2' is not supported; use 'each'")


def test_each_child_of_a_container_is_checkpointed_and_names_stay():
    from torch.distributed._composable.contract import _get_registry

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    names = [n for n, _ in model.named_parameters()]
    mp.set_activation_checkpointing(model)
    apply_activation_checkpointing(model)
    assert [("checkpoint" in (_get_registry(m) or {})) for m in model] == [True, True]
    assert "checkpoint" not in (_get_registry(model) or {})
    assert [n for n, _ in model.named_parameters()] == names
