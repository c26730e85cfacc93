"""What a script does with a module whose parameter another pipeline stage holds (its
stand-in, ``pipeline.absent``), outside the forward: casts, moves and copies keep a
stand-in with the new dtype and the real device; its values are refused; the library
tells it from a tensor the rank holds."""

import copy

import pytest
import torch
from torch import nn

from modelparallel.parallel.pipeline.absent import AbsentValueError, Holder, stand_in
from modelparallel.parallel.placement import is_meta


def linear_held_elsewhere() -> nn.Linear:
    layer = nn.Linear(3, 4)
    layer.weight = nn.Parameter(stand_in(layer.weight, "head.weight", Holder(1, 1),
                                         torch.device("cpu"), None))
    return layer


def test_casts_moves_and_copies_of_a_stand_in_keep_its_metadata():
    """Criterion: ``.half()``, ``.to(device)`` and ``copy.deepcopy`` of the module give
    a parameter with the cast dtype, the shape, requires_grad and device cpu."""
    layer = linear_held_elsewhere().to("cpu").half()
    copied = copy.deepcopy(layer)
    for w in (layer.weight, copied.weight):
        assert isinstance(w, nn.Parameter)
        assert (w.dtype, tuple(w.shape), str(w.device), w.requires_grad) == \
            (torch.float16, (4, 3), "cpu", True)
        assert is_meta(w)  # what FSDP, state dicts and the optimizer skip
    assert not is_meta(layer.bias)


def test_reading_a_stand_ins_values_is_refused_naming_it():
    """Criterion: arithmetic, ``.tolist()`` and ``float()`` raise AbsentValueError with
    the parameter's name, the stage holding it and where to read it instead."""
    w = linear_held_elsewhere().weight
    for read in (lambda: w.sum(), w.tolist, lambda: float(w[0, 0])):
        with pytest.raises(AbsentValueError) as err:
            read()
        assert "the model reads the values of 'head.weight'" in str(err.value)
        assert "which pipeline stage 1 (on pipeline rank 1) holds" in str(err.value)
        assert "model.local_parameters()" in str(err.value)


def test_rearranging_a_stand_in_gives_a_stand_in_and_computing_with_it_is_refused():
    """Criterion: views, reshapes and copies (what state-dict hooks do to what they save,
    e.g. tensor parallelism's fused QKV) give stand-ins of the new shape, named as the
    original; arithmetic on them raises AbsentValueError."""
    w = linear_held_elsewhere().weight.detach()
    shapes = {"reshape": (w.reshape(12), (12,)), "view": (w.view(2, 2, 3), (2, 2, 3)),
              "transpose": (w.t(), (3, 4)), "select": (w[1], (3,)),
              "split": (w.split(2)[1], (2, 3)), "clone": (w.t().contiguous(), (3, 4))}
    for name, (got, shape) in shapes.items():
        assert is_meta(got), name
        assert (tuple(got.shape), got.dtype, str(got.device)) == (shape, w.dtype, "cpu"), name
        with pytest.raises(AbsentValueError) as err:
            got * 2
        assert "the values of 'head.weight'" in str(err.value), name
