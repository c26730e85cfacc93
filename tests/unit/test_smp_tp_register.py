"""``tp_register_with_module``'s two forms (SMP's replacement, modelparallel's plan) and
what the replacement refuses, without processes (``replace_marked`` itself)."""

import pytest
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel

import modelparallel as mp
from modelparallel.parallel.tensor import plans
from modelparallel.smp.v1 import tp_register


class Wide(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.proj = nn.Linear(width, width)


class Other(nn.Module):
    def __init__(self, width=3):
        super().__init__()
        self.width = width
        self.lin = nn.Linear(width, width)


@pytest.fixture
def cls():
    fresh = type("Fresh", (Wide,), {})  # registrations are global: one class per test
    yield fresh
    tp_register.unregister(fresh)
    plans.unregister(fresh)


def test_marked_modules_are_replaced_with_their_constructor_arguments(cls):
    mp.tp_register_with_module(cls, Other, lambda width: ((), {"width": width + 1}))
    with mp.tensor_parallelism():
        inside = cls(4)
    outside = cls(4)
    root = nn.Sequential(inside, outside)
    assert tp_register.replace_marked(root) is root
    assert isinstance(root[0], Other) and root[0].width == 5
    assert root[1] is outside  # not marked: kept (and split by its plan, if any)
    mp.set_tensor_parallelism(outside, False)
    assert tp_register.replace_marked(outside) is outside


def test_the_two_forms_replace_each_other(cls):
    mp.tp_register_with_module(cls, {"proj": ColwiseParallel()})
    assert plans.plan_for(cls(2), plans.TPOptions(2)) is not None
    mp.tp_register_with_module(cls, Other)
    assert plans.plan_for(cls(2), plans.TPOptions(2)) is None
    assert tp_register.replacement_for(cls(2)).dist_module is Other
    mp.tp_register_with_module(cls, {"proj": ColwiseParallel()})
    assert tp_register.replacement_for(cls(2)) is None


def test_registration_mistakes_are_refused(cls):
    with pytest.raises(TypeError, match="hooks go with a distributed module class"):
        mp.tp_register_with_module(cls, {"proj": ColwiseParallel()}, init_hook=lambda: None)
    with pytest.raises(TypeError, match=r"neither an nn\.Module subclass"):
        mp.tp_register_with_module(cls, int)
    with pytest.raises(TypeError, match="init_hook must be callable"):
        mp.tp_register_with_module(cls, Other, 3)
    with pytest.raises(TypeError, match="unknown option"):
        mp.set_tensor_parallelism(cls(2), True, fused_sofmax=True)


def test_a_module_created_before_its_registration_says_what_to_do(cls):
    with mp.tensor_parallelism():
        early = cls(2)
    mp.tp_register_with_module(cls, Other)
    with pytest.raises(RuntimeError, match=r"call smp\.tp_register_with_module before"):
        tp_register.replace_marked(early)
