"""Which modules become FSDP units: automatic discovery and the user's override."""

import pytest
from torch import nn

from modelparallel.models import GPT, GPTConfig
from modelparallel.models.gpt import Block
from modelparallel.parallel.blocks import find_blocks


def gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=16, max_seq_len=8, d_model=8, n_layers=3, n_heads=2))


def test_modulelist_of_identical_blocks():
    model = gpt()
    assert find_blocks(model) == list(model.blocks)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(Head() for _ in range(2))  # repeated, but nested


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(4, 4)
        self.encoder = nn.Sequential(*(Layer() for _ in range(3)))
        self.norms = nn.ModuleList([nn.LayerNorm(4), nn.Linear(4, 4)])  # mixed classes


def test_outermost_repeated_children_of_sequential_only():
    net = Net()
    assert find_blocks(net) == list(net.encoder)


def test_hugging_face_no_split_modules_wins():
    net = Net()
    net._no_split_modules = ["Head"]
    assert find_blocks(net) == [h for layer in net.encoder for h in layer.heads]


def test_parameterless_or_single_children_are_not_blocks():
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert find_blocks(nn.Sequential(nn.ReLU(), nn.ReLU())) == []
    assert find_blocks(nn.Sequential(nn.Sequential(nn.Linear(2, 2)))) == []
    assert find_blocks(seq) == []


def test_root_container_of_blocks():
    seq = nn.Sequential(*(nn.Linear(2, 2) for _ in range(3)))
    assert find_blocks(seq) == list(seq)


@pytest.mark.parametrize("spec", [
    [Block],
    lambda m: isinstance(m, Block),
])
def test_classes_or_predicate(spec):
    model = gpt()
    assert find_blocks(model, spec) == list(model.blocks)


def test_instances_and_none_at_all():
    model = gpt()
    assert find_blocks(model, [model.blocks[1], model.lm_head]) == [model.blocks[1],
                                                                    model.lm_head]
    assert find_blocks(model, []) == []


def test_bad_spec_is_a_type_error():
    with pytest.raises(TypeError, match="module classes or modules"):
        find_blocks(gpt(), ["blocks"])
