"""Splitting a step function's inputs into microbatches and collecting its outputs."""

from collections import OrderedDict, defaultdict, namedtuple

import pytest
import torch

from modelparallel.data import BatchSizeError
from modelparallel.parallel.pipeline.microbatch import (
    StepOutput,
    collect_step_outputs,
    split_step_inputs,
)

Pair = namedtuple("Pair", ["ids", "mask"])


def train_step(model, x, y=None, *, scale=1.0):
    return x


def same(a, b):
    return a.shape == b.shape and torch.equal(a, b)


# ---------------------------------------------------------------------------- splitting


def test_positional_and_keyword_tensors_split_along_axis_0():
    model = object()
    x, y = torch.arange(12).reshape(4, 3), torch.arange(4)
    mbs = split_step_inputs(train_step, (model, x), {"y": y, "scale": 2.0}, 2)
    assert len(mbs) == 2
    for i, (args, kwargs) in enumerate(mbs):
        assert len(args) == 2 and set(kwargs) == {"y", "scale"}  # placement is kept
        assert args[0] is model and kwargs["scale"] == 2.0  # non-tensors passed as-is
        assert same(args[1], x[2 * i:2 * i + 2])
        assert same(kwargs["y"], y[2 * i:2 * i + 2])
        assert train_step(*args, **kwargs) is args[1]  # callable as fn(*args, **kwargs)


def test_pieces_are_views_of_the_input():
    x = torch.zeros(4, 2)
    (a, _), (b, _) = split_step_inputs(train_step, (None, x), {}, 2)
    a[1][0] += 1
    assert x[0, 0] == 1
    assert b[1].data_ptr() == x[2].data_ptr()


def test_keyword_passed_positional_parameter_stays_keyword():
    x = torch.arange(4)
    mbs = split_step_inputs(train_step, (), {"model": None, "x": x}, 2)
    assert [len(args) for args, _ in mbs] == [0, 0]
    assert same(mbs[1][1]["x"], torch.tensor([2, 3]))


def test_one_microbatch_returns_the_call_unchanged():
    args, kwargs = (None, torch.arange(3)), {"y": torch.arange(3)}
    [(a, k)] = split_step_inputs(train_step, args, kwargs, 1)
    assert a is args and k is kwargs


def test_nested_containers_keep_their_types():
    def step(batch):
        return batch

    batch = {
        "pair": Pair(torch.arange(4), torch.ones(4, 2)),
        "list": [torch.arange(8).reshape(4, 2), "label"],
        "tuple": (torch.arange(4), 3),
        "ordered": OrderedDict(a=torch.arange(4)),
    }
    mbs = split_step_inputs(step, (batch,), {}, 2)
    for i, (args, kwargs) in enumerate(mbs):
        (b,) = args
        assert kwargs == {}
        assert type(b) is dict and list(b) == ["pair", "list", "tuple", "ordered"]
        assert type(b["pair"]) is Pair
        assert same(b["pair"].ids, torch.arange(4)[2 * i:2 * i + 2])
        assert same(b["pair"].mask, torch.ones(2, 2))
        assert type(b["list"]) is list and b["list"][1] == "label"
        assert same(b["list"][0], torch.arange(8).reshape(4, 2)[2 * i:2 * i + 2])
        assert type(b["tuple"]) is tuple and b["tuple"][1] == 3
        assert type(b["ordered"]) is OrderedDict
        assert same(b["ordered"]["a"], torch.arange(4)[2 * i:2 * i + 2])


def test_defaultdict_keeps_its_factory():
    def step(d):
        return d

    d = defaultdict(list, t=torch.arange(4))
    (a,), _ = split_step_inputs(step, (d,), {}, 2)[0]
    assert type(a) is defaultdict and a.default_factory is list
    assert same(a["t"], torch.arange(2))
    assert "t" in d and len(d["t"]) == 4  # the input is not modified


def test_containers_without_tensors_are_shared_not_copied():
    def step(cfg, size):
        return cfg

    cfg, size = {"lr": 0.1, "names": ["a", "b"]}, torch.Size([4, 4])
    for args, _ in split_step_inputs(step, (cfg, size), {}, 3):
        assert args[0] is cfg and args[1] is size


def test_zero_dim_tensors_are_passed_whole():
    def step(x, t):
        return x

    t = torch.tensor(5.0)
    for args, _ in split_step_inputs(step, (torch.arange(4), t), {}, 4):
        assert args[1] is t


def test_empty_batch_splits_into_empty_pieces():
    mbs = split_step_inputs(train_step, (None, torch.zeros(0, 3)), {}, 2)
    assert [args[1].shape for args, _ in mbs] == [torch.Size([0, 3])] * 2


class Sliceable:
    def __init__(self, data):
        self.data = data
        self.calls = []

    def smp_slice(self, num_mb, mb_index, axis):
        self.calls.append((num_mb, mb_index, axis))
        return ("slice", mb_index, axis)


def test_objects_with_smp_slice_slice_themselves():
    def step(obj, nested):
        return obj

    obj, inner = Sliceable(1), Sliceable(2)
    mbs = split_step_inputs(step, (obj,), {"nested": [inner]}, 3,
                            input_split_axes={"nested": 1})
    assert [args[0] for args, _ in mbs] == [("slice", i, 0) for i in range(3)]
    assert [kw["nested"] for _, kw in mbs] == [[("slice", i, 1)] for i in range(3)]
    assert obj.calls == [(3, i, 0) for i in range(3)]


def test_non_split_inputs_are_passed_whole():
    def step(x, mask, extra):
        return x

    x, mask, extra = torch.arange(4), torch.ones(4), [torch.zeros(4)]
    mbs = split_step_inputs(step, (x, mask), {"extra": extra}, 2,
                            non_split_inputs=["mask", "extra"])
    for i, (args, kwargs) in enumerate(mbs):
        assert same(args[0], x[2 * i:2 * i + 2])
        assert args[1] is mask and kwargs["extra"] is extra


def test_input_split_axes_picks_the_axis_per_parameter():
    def step(x, y):
        return x

    x, y = torch.arange(24).reshape(2, 4, 3), torch.arange(8).reshape(4, 2)
    mbs = split_step_inputs(step, (x,), {"y": y}, 2, input_split_axes={"x": 1, "y": -2})
    for i, (args, kwargs) in enumerate(mbs):
        assert same(args[0], x[:, 2 * i:2 * i + 2])
        assert same(kwargs["y"], y[2 * i:2 * i + 2])


def test_axis_beyond_the_tensor_names_the_argument():
    def step(x):
        return x

    with pytest.raises(ValueError, match=r"argument 'x' of step has 1 dimensions.*axis 1"):
        split_step_inputs(step, (torch.arange(4),), {}, 2, input_split_axes={"x": 1})


def test_var_positional_and_var_keyword_arguments():
    def step(a, *rest, **extra):
        return a

    t = torch.arange(4)
    mbs = split_step_inputs(step, (t, t, t), {"m": t, "keep": t}, 2,
                            non_split_inputs=["keep"], input_split_axes={"rest": 0})
    for i, (args, kwargs) in enumerate(mbs):
        assert len(args) == 3 and set(kwargs) == {"m", "keep"}
        assert all(same(a, t[2 * i:2 * i + 2]) for a in (*args, kwargs["m"]))
        assert kwargs["keep"] is t


def test_var_keyword_name_covers_all_extra_keywords():
    def step(x, **extra):
        return x

    t = torch.arange(4)
    mbs = split_step_inputs(step, (t,), {"a": t, "b": [t]}, 2, non_split_inputs=["extra"])
    assert all(kw["a"] is t and kw["b"][0] is t for _, kw in mbs)


@pytest.mark.parametrize(("args", "kwargs", "path"), [
    ((None, torch.zeros(5, 2)), {}, "argument 'x' of train_step has 5 samples"),
    ((None, torch.zeros(4)), {"y": {"ids": torch.zeros(6)}},
     "argument 'y'['ids'] of train_step has 6 samples"),
    ((None, [torch.zeros(4), Pair(torch.zeros(4), torch.zeros(3))]), {},
     "argument 'x'[1].mask of train_step has 3 samples"),
])
def test_indivisible_batch_names_the_argument_path(args, kwargs, path):
    with pytest.raises(BatchSizeError) as err:
        split_step_inputs(train_step, args, kwargs, 4)
    message = str(err.value)
    assert message.startswith(path)
    assert "microbatches=4" in message and "drop_last=True" in message


def test_indivisible_batch_checked_along_the_configured_axis():
    with pytest.raises(BatchSizeError, match="has 3 samples"):
        split_step_inputs(train_step, (None, torch.zeros(4, 3)), {}, 2,
                          input_split_axes={"x": 1})


@pytest.mark.parametrize("option", ["non_split_inputs", "input_split_axes"])
def test_unknown_parameter_names_are_rejected(option):
    value = ["labels"] if option == "non_split_inputs" else {"labels": 0}
    with pytest.raises(ValueError) as err:
        split_step_inputs(train_step, (None, torch.zeros(4)), {}, 2, **{option: value})
    message = str(err.value)
    assert option in message and "'labels'" in message and "train_step" in message
    assert "['model', 'x', 'y', 'scale']" in message


def test_unknown_names_rejected_even_with_one_microbatch():
    with pytest.raises(ValueError, match="'nope'"):
        split_step_inputs(train_step, (None, torch.zeros(4)), {}, 1, non_split_inputs=["nope"])


def test_name_in_both_options_is_rejected():
    with pytest.raises(ValueError, match="both"):
        split_step_inputs(train_step, (None, torch.zeros(4)), {}, 2,
                          non_split_inputs=["x"], input_split_axes={"x": 0})


def test_bad_options_and_calls():
    x = torch.zeros(4)
    with pytest.raises(TypeError, match="collection of names"):
        split_step_inputs(train_step, (None, x), {}, 2, non_split_inputs="x")
    with pytest.raises(ValueError, match="int axis"):
        split_step_inputs(train_step, (None, x), {}, 2, input_split_axes={"x": "0"})
    with pytest.raises(ValueError, match="at least 1"):
        split_step_inputs(train_step, (None, x), {}, 0)
    with pytest.raises(TypeError):  # does not fit the signature
        split_step_inputs(train_step, (None, x), {"bogus": 1}, 2)


# ---------------------------------------------------------------------------- StepOutput


def test_step_output_reductions_match_hand_computation():
    outs = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0]), torch.tensor([5.0, 1.0])]
    so = StepOutput(outs)
    assert len(so) == 3 and so[1] is outs[1] and list(so) == outs
    assert torch.allclose(so.reduce_mean(), torch.tensor([3.0, 3.0]))
    assert torch.allclose(so.reduce_sum(), torch.tensor([9.0, 9.0]))
    assert same(so.concat(), torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 1.0]))
    assert same(so.stack(), torch.tensor([[1.0, 2.0], [3.0, 6.0], [5.0, 1.0]]))


def test_step_output_of_scalar_tensors():
    so = StepOutput([torch.tensor(1.0), torch.tensor(4.0)])
    assert so.reduce_mean().item() == 2.5 and so.reduce_mean().dim() == 0
    assert so.reduce_sum().item() == 5.0
    assert same(so.concat(), torch.tensor([1.0, 4.0]))  # 0-dim outputs are stacked
    assert same(so.stack(), torch.tensor([1.0, 4.0]))


def test_step_output_mean_of_integer_tensors_is_float():
    so = StepOutput([torch.tensor(3), torch.tensor(4)])
    assert so.reduce_mean().item() == 3.5
    assert so.reduce_sum().item() == 7 and so.reduce_sum().dtype == torch.int64


def test_step_output_reductions_keep_autograd():
    w = torch.ones(2, requires_grad=True)
    StepOutput([w * 1.0, w * 3.0]).reduce_mean().sum().backward()
    assert torch.equal(w.grad, torch.tensor([2.0, 2.0]))


def test_step_output_of_numbers():
    so = StepOutput([1, 2, 4])
    mean = so.reduce_mean()
    assert isinstance(mean, float) and mean == pytest.approx(7 / 3)
    assert so.reduce_sum() == 7
    assert same(so.stack(), torch.tensor([1, 2, 4]))


@pytest.mark.parametrize("op", ["reduce_mean", "reduce_sum", "concat", "stack"])
def test_step_output_of_other_values_refuses_to_reduce(op):
    so = StepOutput(["a", "b"])
    with pytest.raises(TypeError, match=rf"StepOutput.{op}.*outputs are str"):
        getattr(so, op)()
    with pytest.raises(TypeError, match="outputs are Tensor, float"):
        getattr(StepOutput([torch.tensor(1.0), 2.0]), op)()


def test_step_output_repr_is_helpful():
    text = repr(StepOutput([torch.tensor(0.5), torch.zeros(2, 3)]))
    assert text.startswith("StepOutput(2 microbatches")
    assert "tensor(0.5)" in text and "Tensor[2, 3] float32" in text


# ---------------------------------------------------------------------------- collecting


def test_collect_a_single_value():
    outs = [torch.tensor(1.0), torch.tensor(2.0)]
    so = collect_step_outputs(outs)
    assert isinstance(so, StepOutput) and so.outputs == outs


def test_collect_none():
    assert collect_step_outputs([None, None]) is None


def test_collect_tuple_gives_one_step_output_per_position():
    loss, correct = collect_step_outputs([(torch.tensor(1.0), 3), (torch.tensor(3.0), 5)])
    assert loss.reduce_mean().item() == 2.0
    assert correct.reduce_sum() == 8


def test_collect_nested_structure():
    per_mb = [
        {"loss": torch.tensor(float(i)), "aux": [Pair(i, None), torch.full((2,), float(i))]}
        for i in range(3)
    ]
    out = collect_step_outputs(per_mb)
    assert type(out) is dict and list(out) == ["loss", "aux"]
    assert out["loss"].reduce_sum().item() == 3.0
    assert type(out["aux"]) is list and type(out["aux"][0]) is Pair
    assert out["aux"][0].ids.outputs == [0, 1, 2] and out["aux"][0].mask is None
    assert same(out["aux"][1].concat(), torch.tensor([0.0, 0.0, 1.0, 1.0, 2.0, 2.0]))


@pytest.mark.parametrize("per_mb", [
    [(1, 2), (1, 2, 3)],
    [(1, 2), [1, 2]],
    [{"a": 1}, {"b": 1}],
    [None, torch.tensor(1.0)],
    [(1, None), (1, 2)],
    [1, (1,)],
])
def test_collect_rejects_differing_structures(per_mb):
    with pytest.raises(ValueError, match="differently structured"):
        collect_step_outputs(per_mb)


def test_collect_needs_outputs():
    with pytest.raises(ValueError):
        collect_step_outputs([])


def test_split_then_collect_round_trip():
    def step(x):
        return (x * 2).sum(), x * 2

    x = torch.arange(8.0).reshape(4, 2)
    mbs = split_step_inputs(step, (x,), {}, 4)
    total, doubled = collect_step_outputs([step(*a, **k) for a, k in mbs])
    assert total.reduce_sum().item() == (x * 2).sum().item()
    assert same(doubled.concat(), x * 2)
