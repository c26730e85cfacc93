"""mp.set_activation_checkpointing: marking, and the strategies it refuses."""

import pytest
import torch
from torch import nn

import modelparallel as mp
from modelparallel.parallel.activation import apply_activation_checkpointing, is_recomputed


def test_unsupported_strategy_names_the_supported_one():
    with pytest.raises(ValueError) as err:
        mp.set_activation_checkpointing(nn.Linear(2, 2), strategy="group_2")
    assert str(err.value).startswith("strategy='group_2' is not supported; use 'each'")


def test_each_child_of_a_container_is_checkpointed_and_names_stay():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    names = [n for n, _ in model.named_parameters()]
    mp.set_activation_checkpointing(model)
    apply_activation_checkpointing(model)
    assert [is_recomputed(m) for m in model] == [True, True]
    assert not is_recomputed(model)
    assert [n for n, _ in model.named_parameters()] == names


def test_recomputation_gives_the_same_gradients_and_may_run_twice():
    """Zero-bubble schedules take the input and the weight gradients in two passes,
    each recomputing a checkpointed module; torch's composable checkpoint refused that."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    checked = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    checked.load_state_dict(plain.state_dict())
    mp.set_activation_checkpointing(checked[0])
    apply_activation_checkpointing(checked)
    x = torch.randn(3, 4, requires_grad=True)
    for model in (plain, checked):
        out = model(x).pow(2).sum()
        (dx,) = torch.autograd.grad(out, [x], retain_graph=True)  # first recomputation
        dw = torch.autograd.grad(out, [model[0].weight])  # second
        model.grads = (dx, dw[0])
    assert all(torch.allclose(a, b) for a, b in zip(plain.grads, checked.grads, strict=True))
