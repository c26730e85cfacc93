"""SMP v1's module replacement for tensor parallelism, in 2 real processes: a Hugging Face
GPT-2 created under ``smp.tensor_parallelism()`` becomes ``smp.nn``'s
``DistributedTransformerLMHead`` with its weights, split over 2 tensor-parallel ranks,
and trains like the Hugging Face model in one process; a class registered with
``tp_register_with_module(cls, dist_module, hooks)`` (or ``@tp_register``) is replaced,
its constructor arguments and ``tensor_parallelism(**options)`` reaching the new module.
"""

import functools
import logging
import os

import pytest
import torch
from torch import nn

import modelparallel as smp
from modelparallel.smp.v1 import tp_register
from modelparallel.smp.v1.nn.huggingface.gpt2 import translate_state_dict_to_hf_gpt2

transformers = pytest.importorskip("transformers")

STEPS, BATCH, SEQ, VOCAB = 3, 4, 16, 64


def gpt2_config():
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                   n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                   use_cache=False)


def batches():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@functools.cache
def reference():
    """The Hugging Face GPT-2 trained in one plain process."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gpt2_config())
    opt, losses = sgd(model.parameters()), []
    for ids in batches():
        loss = model(input_ids=ids, labels=ids)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def gpt2_case():
    os.environ["SMP_USE_HF_GELU"] = "1"  # GPT-2's tanh GeLU in SMP's modules, as in SMP
    try:
        smp.init({"tensor_parallel_degree": 2})
        torch.manual_seed(0)
        with smp.model_creation(tensor_parallelism=True):
            hf = transformers.GPT2LMHeadModel(gpt2_config())
        model = smp.DistributedModel(hf)
    finally:
        del os.environ["SMP_USE_HF_GELU"]
    lm = model.get_module()
    assert isinstance(lm, smp.nn.DistributedTransformerLMHead), type(lm)
    assert lm.transformer.h is lm.transformer.seq_layers  # train_gpt_simple reads either
    assert lm.transformer.seq_layers[0].output.hf_gelu
    opt = smp.DistributedOptimizer(sgd(model.parameters()))

    @smp.step
    def step(model, ids):
        out = model(input_ids=ids, labels=ids)
        model.backward(out["loss"])
        return out["loss"]

    losses = []
    for ids in batches():  # both tensor-parallel ranks take the same batch
        losses.append(step(model, ids).reduce_mean().item())
        opt.step()
        opt.zero_grad()
    split = [n for n, p in model.local_named_parameters() if hasattr(p, "to_local")]
    return losses, translate_state_dict_to_hf_gpt2(model.state_dict()), split


def test_gpt2_becomes_the_distributed_lm_head_and_trains_like_hugging_face(workers):
    ref_losses, ref_state = reference()
    for losses, state, split in workers(2).run(gpt2_case):
        assert "transformer.seq_layers.0.attention.query.weight" in split
        for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
            assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs {b}"
        assert set(state) == set(ref_state), set(state) ^ set(ref_state)
        for name, ref in ref_state.items():
            diff = (state[name] - ref).abs().max().item()
            assert diff <= 1e-5 * ref.abs().max().item() + 1e-8, f"{name}: {diff}"


class Block(nn.Module):
    """A user's transformer block with its own constructor and call convention."""

    def __init__(self, width, heads, *, ffn=64):
        super().__init__()
        self.width, self.heads, self.ffn = width, heads, ffn
        self.proj = nn.Linear(width, width)

    def forward(self, x, mask=None):
        return self.proj(x)


def block_init_hook(width, heads, *, ffn=64):
    return (), dict(num_attention_heads=heads, attention_head_size=width // heads,
                    hidden_size=width, intermediate_size=ffn, attention_dropout_prob=0.0,
                    hidden_dropout_prob=0.0, causal_mask_size=SEQ)


def block_forward_hook(x, mask=None):
    return ((x, mask),), {}


def block_return_hook(out):
    return out[0]


class Net(nn.Module):
    def __init__(self, registered):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        with smp.tensor_parallelism(attention_in_fp32=True, fused_softmax=True):
            self.block = registered(32, 4, ffn=48)
        with smp.tensor_parallelism(fused_softmax=True):  # nothing replaces a Linear
            self.head = nn.Linear(32, VOCAB)

    def forward(self, ids):
        return self.head(self.block(self.embed(ids)))


def registered_case(form: str):
    smp.init({"tensor_parallel_degree": 2})
    cls = type("Block2", (Block,), {})  # a fresh class per case: registrations are global
    if form == "decorator":
        smp.tp_register(smp.nn.DistributedTransformerLayer, block_init_hook,
                        block_forward_hook, block_return_hook)(cls)
    else:
        smp.tp_register_with_module(cls, smp.nn.DistributedTransformerLayer, block_init_hook,
                                    block_forward_hook, block_return_hook)
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("modelparallel")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        torch.manual_seed(0)
        net = Net(cls)
        model = smp.DistributedModel(net)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        tp_register.unregister(cls)
    layer = model.get_module().block
    assert isinstance(layer, smp.nn.DistributedTransformerLayer), type(layer)
    assert layer.output.intermediate_size == 48  # the constructor's keyword argument
    assert layer.attention.attention_in_fp32 is True  # tensor_parallelism(**options)
    ids = batches()[0]

    @smp.step
    def forward(model, ids):
        return model(ids)

    logits = forward(model, ids).outputs[0]
    # one process: the same weights in plain modules give the same logits
    full = model.state_dict()
    plain = Net.__new__(Net)
    nn.Module.__init__(plain)
    plain.embed, plain.head = nn.Embedding(VOCAB, 32), nn.Linear(32, VOCAB)
    plain.block = smp.nn.DistributedTransformerLayer(**block_init_hook(32, 4, ffn=48)[1],
                                                     attention_in_fp32=True)
    plain.forward = lambda ids: plain.head(plain.block((plain.embed(ids), None))[0])
    plain.load_state_dict(full)
    expected = plain(ids)
    return (logits - expected).abs().max().item(), records


@pytest.mark.parametrize("form", ["call", "decorator"])
def test_a_registered_class_is_replaced_with_its_arguments_and_hooks(workers, form):
    (diff0, messages), (diff1, _) = workers(2).run(registered_case, form=form)
    assert diff0 < 1e-5 and diff1 < 1e-5
    assert any("Block2 replaced by smp.nn's DistributedTransformerLayer" in m
               and "own initialisation" in m for m in messages), messages
    # the options reached the replacement; only the Linear split in place ignores them
    no_effect = [m for m in messages if "has no effect on" in m]
    assert len(no_effect) == 1 and "fused_softmax=True) has no effect on Linear" in \
        no_effect[0], messages


def delayed_case():
    smp.init({"tensor_parallel_degree": 2, "delayed_parameter_initialization": True})
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        hf = transformers.GPT2LMHeadModel(gpt2_config())
    assert all(p.is_meta for p in hf.parameters())
    model = smp.DistributedModel(hf)
    lm = model.get_module()
    meta_before = all(p.is_meta for p in lm.parameters())

    @smp.step
    def step(model, ids):
        out = model(input_ids=ids, labels=ids)
        model.backward(out["loss"])
        return out["loss"]

    loss = step(model, batches()[0]).reduce_mean().item()
    held = [p for _, p in model.local_named_parameters()]
    std = model.state_dict()["word_embedding.weight"].std().item()
    return meta_before, any(p.is_meta for p in held), loss, std


def test_a_model_created_with_delayed_initialization_is_replaced_delayed(workers):
    for meta_before, meta_after, loss, std in workers(2).run(delayed_case):
        assert meta_before and not meta_after
        assert abs(loss - torch.log(torch.tensor(float(VOCAB))).item()) < 0.5  # ~ uniform
        assert abs(std - 0.02) < 0.005  # SMP's initializer_range, not left empty
