"""DataFlow marks what is computed from marked tensors; parameter views shadow and restore."""

import pytest
import torch
from torch import nn

from modelparallel.parallel.dataflow import DataFlow
from modelparallel.parallel.param_views import add_view


def test_marks_follow_ops_views_and_in_place_writes():
    a, b, c = torch.randn(3), torch.randn(3), torch.randn(3)
    with DataFlow() as flow:
        flow.mark(a)
        d = (a * 2).view(3, 1).sum(1)  # derived through several ops
        e = b + c  # not derived
        c.add_(a)  # written in place from a marked tensor
        f = torch.zeros(3)
        f[0] = d[0]  # __setitem__ writes into f
        mask = a > 0  # a boolean: finite, but still derived
    assert flow.is_marked(d) and flow.is_marked(c) and flow.is_marked(f)
    assert flow.is_marked(mask)
    assert not flow.is_marked(e) and not flow.is_marked(b)


def test_a_handler_can_replace_the_unmarked_inputs_of_an_op():
    seen = []

    def double_unmarked(func, flat):
        seen.append(getattr(func, "__name__", ""))
        return [t * 2 if isinstance(t, torch.Tensor) and not flow.is_marked(t) else t
                for t in flat]

    x, w = torch.ones(2), torch.ones(2)
    with DataFlow(double_unmarked) as flow:
        flow.mark(x)
        y = x * w
    assert torch.equal(y, torch.full((2,), 2.0)) and "mul" in seen[0]


def test_views_compose_in_order_and_leave_the_parameter_alone():
    lin = nn.Linear(2, 2)
    add_view(lin, lambda w: w * 3, ["weight"])
    add_view(lin, lambda w: w + 1, ["weight"])
    add_view(lin, lambda w: w * 0 + 5, ["bias"], first=True)
    seen = {}
    lin.register_forward_hook(lambda m, a, o: seen.update(w=m.weight, b=m.bias), prepend=True)
    weight = lin.weight
    out = lin(torch.ones(1, 2))
    assert torch.equal(seen["w"], weight.detach() * 3 + 1)
    assert torch.equal(seen["b"], torch.full((2,), 5.0))
    assert lin.weight is weight and "weight" not in lin.__dict__  # restored after forward
    out.sum().backward()
    assert torch.equal(weight.grad, torch.full((2, 2), 3.0))  # through the chain


def test_views_are_restored_when_the_forward_raises():
    class Boom(nn.Linear):
        def forward(self, x):
            raise ValueError("boom")

    m = Boom(2, 2)
    add_view(m, lambda w: w.double(), ["weight"])
    with pytest.raises(ValueError, match="boom"):
        m(torch.ones(2))
    assert "weight" not in m.__dict__ and isinstance(m.weight, nn.Parameter)
