"""A value that crosses a pipeline cut other than as an argument of the unit where the
stage starts is an error, even when the stand-in it comes from yields finite numbers
(found by data flow, not value). The split's trace avoids such cuts; what the trace did
not see (another path through the model) is caught at the first step."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modelparallel as mp
from modelparallel.testing import WorkerError


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, h, gate):
        return h + torch.tanh(self.fc(h)) * gate


class GatedModel(nn.Module):
    """Every layer is gated by a mask computed from the embedding: on a later stage the
    embedding is a stand-in, and ``emb > 0`` of its NaN output is a finite all-False;
    the mask is an argument of every layer, so it crosses every cut with the hidden
    state."""

    def __init__(self, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(Layer() for _ in range(layers))
        self.head = nn.Linear(16, 32)

    def forward(self, x):
        h = self.embed(x)
        gate = (h > 0).float()  # a value derived from the embedding, used by every layer
        for layer in self.layers:
            h = layer(h, gate)
        return self.head(h)


class GradOnlyGate(GatedModel):
    """Gates the output with the mask only when gradients are on: the split's trace
    (without gradients) does not see the mask reach the output, a training step does."""

    def forward(self, x):
        h = self.embed(x)
        gate = (h > 0).float()
        for layer in self.layers:
            h = layer(h, 1.0)
        if torch.is_grad_enabled():
            h = h * gate
        return self.head(h)


class PlainModel(GatedModel):
    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h, 1.0)
        return self.head(h)


@mp.step
def train_step(model, x, y):
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    model.backward(loss)
    return loss


def leak_case(model_class: str) -> float:
    mp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    torch.manual_seed(0)
    model = mp.DistributedModel({"gated": GatedModel, "plain": PlainModel,
                                 "grad_only": GradOnlyGate}[model_class]())
    x = torch.randint(32, (4, 8))
    return float(train_step(model, x, x).reduce_mean())


def test_a_finite_leaked_value_is_named_on_the_stage_that_reads_it(workers):
    with pytest.raises(WorkerError) as err:
        workers(2).run(leak_case, model_class="grad_only")
    msg = str(err.value)
    assert "LeakedActivationError: pipeline stage 1: the arguments of" in msg or \
        "LeakedActivationError: pipeline stage 1: its output" in msg
    assert "computed from the output of a module another stage holds" in msg
    assert "embed" in msg  # the stand-in whose output leaked


@pytest.mark.parametrize("model_class", ["plain", "gated"])
def test_values_passed_to_the_layers_are_not_flagged(workers, model_class):
    losses = workers(2).run(leak_case, model_class=model_class)
    assert losses[0] == losses[1]
