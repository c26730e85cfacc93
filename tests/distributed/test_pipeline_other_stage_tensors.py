"""The SMP v1 pipeline runs models whose forward reads tensors another stage holds.

The model's own forward runs on every stage, so a stage may read a parameter of a
module another stage holds. Its metadata (dtype, shape, device, ``requires_grad``,
Hugging Face's ``model.dtype`` / ``model.device``) answers as on the holding stage, and
training has parity with one process: a BERT built from a small ``BertConfig`` with the
classic forward (the attention mask in ``embeddings.word_embeddings.weight.dtype``, as
NVIDIA's BERT and transformers 4 do), and a small model reading a first-stage
parameter's metadata on the second stage. Reading another stage's values is refused with
a message naming the parameter, its stage and the fix. Checkpoints hold exactly the
model's own parameters.
"""

import copy
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from transformers import BertConfig, BertForMaskedLM
from transformers.modeling_utils import ModuleUtilsMixin

import modelparallel as mp
from modelparallel.testing import TrainResult, WorkerError, assert_parity

STEPS, BATCH, SEQ, VOCAB, WIDTH = 3, 4, 8, 32, 16


class ClassicBert(BertForMaskedLM):
    """BertForMaskedLM with the classic forward: an additive attention mask in the
    embeddings' dtype, checked against Hugging Face's ``model.dtype`` / ``model.device``
    (both read the first of ``parameters()``)."""

    def forward(self, input_ids, attention_mask):
        dtype = self.bert.embeddings.word_embeddings.weight.dtype
        assert dtype == self.dtype and self.device == input_ids.device
        mask = (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
        hidden = self.bert.embeddings(input_ids=input_ids)
        hidden = self.bert.encoder(hidden, attention_mask=mask).last_hidden_state
        return self.cls(hidden)


def bert() -> ClassicBert:
    torch.manual_seed(0)
    return ClassicBert(BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        vocab_size=256, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


class MetadataReader(ModuleUtilsMixin, nn.Module):
    """Its last layers read the embedding's metadata (``seen``: what they read)."""

    def __init__(self, head_reads_values: str = ""):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.l1, self.l2 = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.head_reads_values = head_reads_values
        self.seen: list[tuple] = []

    def forward(self, ids):
        h = self.l1(self.embed(ids))
        w = self.embed.weight
        self.seen.append((w.dtype, tuple(w.shape), str(w.device), w.requires_grad, w.ndim,
                          w.is_floating_point(), self.embed.embedding_dim, self.dtype,
                          str(self.device)))
        h = self.l2(h.to(w.device, w.dtype)) / w.shape[1] ** 0.5
        # a tied head computed with the embedding's weight: "always", or "untraced" (in a
        # branch the split's trace does not take, so that only the run can refuse it)
        if self.head_reads_values == "always" or (self.head_reads_values == "untraced"
                                                  and not mp.is_tracing()):
            return h @ w.T
        return self.head(h + w.new_ones(w.shape[1]))


def vocab(model: str) -> int:
    return 256 if model == "bert" else VOCAB


def batches(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(vocab, (BATCH, SEQ), generator=g)
        mask = torch.ones(BATCH, SEQ)
        mask[:, SEQ - 2:] = 0  # padding: the mask matters
        out.append((ids, mask, torch.randint(vocab, (BATCH, SEQ), generator=g)))
    return out


def make(model: str) -> nn.Module:
    if model == "bert":
        return bert()
    torch.manual_seed(0)
    return MetadataReader()


def call(net, model: str, ids, mask):
    return net(ids, mask) if model == "bert" else net(ids)


def sgd(params):  # Adam would turn the round-off in zero gradients into whole steps
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def optimizer_state(optimizer, params: dict[str, nn.Parameter]):
    return {name: {k: v.detach().cpu().clone() for k, v in optimizer.state[p].items()}
            for name, p in params.items()}


def reference(model: str):
    net = make(model)
    optimizer = sgd(net.parameters())
    losses = []
    for ids, mask, labels in batches(vocab(model)):
        optimizer.zero_grad()
        logits = call(net, model, ids, mask)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    params = dict(net.named_parameters(remove_duplicate=False))
    return (TrainResult(losses, {k: v.detach().clone() for k, v in net.state_dict().items()}),
            optimizer_state(optimizer, params))


def parity_case(model: str, checkpoints: str | None = None, recompute: bool = False):
    """Train at pp2 and compare with one process; ``recompute``: BERT's encoder layers
    under activation checkpointing (the calls of each layer's output block in the last
    step are counted, as they begin: twice per microbatch when the backward
    recomputes it)."""
    mp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    ref, ref_optimizer = reference(model)
    module = make(model)
    calls: dict[str, int] = {}
    if recompute:
        for i, layer in enumerate(module.bert.encoder.layer):
            mp.set_activation_checkpointing(layer)
            layer.output.register_forward_pre_hook(
                lambda *_, name=f"layer {i}": calls.__setitem__(name, calls.get(name, 0) + 1))
    net = mp.DistributedModel(module)
    optimizer = mp.DistributedOptimizer(sgd(net.parameters()))

    @mp.step
    def train_step(net, ids, mask, labels):
        logits = call(net, model, ids, mask)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        net.backward(loss)
        return loss

    losses = []
    for ids, mask, labels in batches(vocab(model)):
        optimizer.zero_grad()
        calls.clear()
        losses.append(float(train_step(net, ids, mask, labels).reduce_mean()))
        optimizer.step()
    assert_parity(TrainResult(losses, net.state_dict()), ref)
    # the optimizer state of every parameter this rank holds (its momentum)
    held = dict(net.local_named_parameters())
    mine = optimizer_state(optimizer.optimizer, held)
    assert_parity(TrainResult([], {f"{n}.{k}": v for n, s in mine.items() for k, v in s.items()}),
                  TrainResult([], {f"{n}.{k}": v for n, s in ref_optimizer.items()
                                   if n in held for k, v in s.items()}))
    seen = getattr(net.module, "seen", [])
    saved = None
    if checkpoints is not None:
        mp.save_checkpoint(checkpoints, "partial", partial=True)
        mp.save_checkpoint(checkpoints, "full", partial=False)
        saved = saved_names(checkpoints)
    return sorted(held), seen[-1] if seen else None, saved, sorted(ref.params), calls


def saved_names(checkpoints: str) -> tuple[list[str], list[str]]:
    """The model tensors in the sharded (DCP) and the full (safetensors) checkpoint."""
    meta = dcp.FileSystemReader(os.path.join(checkpoints, "partial", "sharded")).read_metadata()
    sharded = sorted(k.removeprefix("model.") for k in meta.state_dict_metadata
                     if k.startswith("model."))
    return sharded, sorted(load_file(os.path.join(checkpoints, "full", "model.safetensors")))


@pytest.mark.extended
def test_a_bert_that_reads_the_embeddings_dtype_trains_with_parity(workers):
    """Criterion: losses of every step, final parameters and momentum as one process
    (the second stage reads ``bert.embeddings.word_embeddings.weight.dtype``,
    ``model.dtype`` and ``model.device`` of parameters the first stage holds)."""
    results = workers(2).run(parity_case, model="bert")
    held = [set(r[0]) for r in results]
    assert "bert.embeddings.word_embeddings.weight" in held[0]
    assert not any(n.startswith("bert.embeddings.") for n in held[1] - held[0])


def test_a_bert_with_activation_checkpointing_trains_with_parity(workers):
    """Criterion: the same BERT with every encoder layer under activation checkpointing
    (mp.set_activation_checkpointing) trains as one process without it (losses,
    parameters, momentum); each stage recomputes the layer it holds in the backward."""
    results = workers(2).run(parity_case, model="bert", recompute=True)
    assert [r[-1] for r in results] == [{"layer 0": 4}, {"layer 1": 4}]  # 2 microbatches


def test_another_stages_parameter_metadata_is_read_truthfully(workers, tmp_path):
    """Criterion: the second stage reads the first stage's ``embed.weight`` metadata as
    one process does (dtype, shape, device, requires_grad, ndim, HF's model.dtype and
    model.device), trains with parity, and its checkpoints (sharded and full) hold
    exactly the model's own parameters."""
    results = workers(2).run(parity_case, model="reader", checkpoints=str(tmp_path))
    (held0, _, saved, names, _), (held1, seen, _, _, _) = results
    assert "embed.weight" in held0 and "embed.weight" not in held1
    assert seen == (torch.float32, (VOCAB, WIDTH), "cpu", True, 2, True, WIDTH,
                    torch.float32, "cpu")
    sharded, full = saved
    assert sharded == names and full == names  # no stand-in, no placeholder, none missing


def outside_forward_case():
    """What a script reads of the model after the split, outside the forward."""
    mp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    one = {n: (p.dtype, tuple(p.shape), str(p.device), p.requires_grad)
           for n, p in bert().named_parameters()}
    net = mp.DistributedModel(bert())
    optimizer = mp.DistributedOptimizer(sgd(net.parameters()))

    @mp.step
    def train_step(net, ids, mask, labels):
        loss = F.cross_entropy(net(ids, mask).flatten(0, 1), labels.flatten())
        net.backward(loss)
        return loss

    ids, mask, labels = batches(256)[0]
    train_step(net, ids, mask, labels)
    optimizer.step()
    hf = net.get_module()
    seen = {n: (p.dtype, tuple(p.shape), str(p.device), p.requires_grad)
            for n, p in hf.named_parameters()}
    elsewhere = sorted(set(seen) - {n for n, _ in net.local_named_parameters()})
    refusal = None
    if elsewhere:
        try:
            float(hf.get_parameter(elsewhere[0]).sum())
        except Exception as e:
            refusal = f"{type(e).__name__}: {e}"
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return {"one process": one, "seen": seen, "elsewhere": elsewhere, "refusal": refusal,
            "HF dtype and device": (hf.dtype, str(hf.device), str(next(net.parameters()).device)),
            "optimizes only its own": optimized == {id(p) for p in net.local_parameters()},
            "copy": str(copy.deepcopy(hf).get_parameter(elsewhere[0]).device)
            if elsewhere else None}


def test_another_stages_parameters_report_their_metadata_outside_the_forward(workers):
    """Criterion: after the split, a script reads every parameter's dtype, shape,
    device and requires_grad, HF's model.dtype / model.device and
    next(model.parameters()).device as one process does (cpu here, not meta), on the
    stage that holds it and on the other; the optimizer has only the rank's own; reading
    another stage's values is refused naming the parameter, its stage and the fix."""
    results = workers(2).run(outside_forward_case)
    for r in results:
        assert r["seen"] == r["one process"]
        assert r["HF dtype and device"] == (torch.float32, "cpu", "cpu")
        assert r["optimizes only its own"]
    assert results[1]["elsewhere"], "the second stage holds every parameter"
    assert "bert.embeddings.position_embeddings.weight" in results[1]["elsewhere"]
    assert results[1]["copy"] == "cpu"  # copy.deepcopy of the model keeps the device
    name = results[1]["elsewhere"][0]
    refusal = results[1]["refusal"]
    assert refusal.startswith(f"AbsentValueError: the model reads the values of {name!r} "
                              "(in torch operation 'sum'), which pipeline stage 0"), refusal
    assert "read them from model.state_dict()" in refusal


def refused_case(reads: str):
    mp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    torch.manual_seed(0)
    model = MetadataReader(head_reads_values=reads)
    for stage, layers in enumerate(((model.embed, model.l1), (model.l2, model.head))):
        for layer in layers:
            mp.set_partition(layer, stage)
    net = mp.DistributedModel(model)

    @mp.step
    def train_step(net, ids):
        loss = net(ids).float().pow(2).mean()
        net.backward(loss)
        return loss

    return float(train_step(net, torch.randint(VOCAB, (BATCH, SEQ))).reduce_mean())


def test_reading_another_stages_parameter_values_is_refused(workers):
    """Criterion: a model computing with a weight on another stage than the one holding
    it is refused before the first step when the split's trace sees it, with the reason;
    and when only the run does (a branch the trace did not take), the stage stops with
    one message naming the parameter, the stage that holds it and the fix."""
    with pytest.raises(WorkerError) as err:
        workers(2).run(refused_case, reads="always")
    msg = str(err.value)
    assert "stage 1 cannot start at 'l2'" in msg
    assert "the model's own forward uses the parameters of 'embed'" in msg
    with pytest.raises(WorkerError) as err:
        workers(2).run(refused_case, reads="untraced")
    msg = str(err.value)
    assert "AbsentValueError: the model reads the values of 'embed.weight'" in msg
    assert "which pipeline stage 0 (on pipeline rank 0) holds" in msg
    assert "call that module instead of computing with its weight" in msg
    assert "mp.set_partition" in msg
