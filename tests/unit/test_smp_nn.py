"""smp.nn (SMP v1) and tsm.tensor_parallel.transformer (SMP v2) modules against reference
computations: SMP's documented reference layers (the appendix of its tensor-parallelism
page) and Hugging Face GPT-2 through SMP's state-dict translators. The attention modules:
test_smp_nn_attn.py."""

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from modelparallel.config import ConfigError
from modelparallel.parallel.tensor.plans import TPOptions
from modelparallel.parallel.tensor.transform import find_plans
from modelparallel.smp import nn as smp_nn
from modelparallel.smp.v1.nn.huggingface import gpt2 as hf_gpt2
from modelparallel.smp.v2.nn.tensor_parallel_transformer import (
    TETransformerLayer,
    TransformerLayer,
    TransformerLMHead,
)

TOL = dict(rtol=1e-5, atol=1e-6)


# -- SMP v1: the documented reference layers (appendix), written out ---------------------

class RefAttention(nn.Module):
    """SMP's appendix ``AttentionLayer``, with the residual added also without a post-layer
    norm (SMP's source does; the appendix drops it there, which would break GPT-2)."""

    def __init__(self, heads, head_size, hidden, causal, pre, post, cross=False, eps=1e-5):
        super().__init__()
        self.heads, self.head_size, self.causal, self.cross = heads, head_size, causal, cross
        for name in ("query", "key", "value"):
            setattr(self, name, nn.Linear(hidden, heads * head_size))
        self.dense = nn.Linear(heads * head_size, hidden)
        self.pre_layernorm = nn.LayerNorm(hidden, eps=eps) if pre else None
        self.layernorm = nn.LayerNorm(hidden, eps=eps) if post else None

    def transpose(self, t, key=False):
        t = t.reshape(*t.shape[:-1], self.heads, self.head_size)
        return t.permute(0, 2, 3, 1) if key else t.permute(0, 2, 1, 3)

    def forward(self, inp):
        hidden, cross, mask = inp if self.cross else (inp[0], None, inp[1])
        norm = self.pre_layernorm(hidden) if self.pre_layernorm else hidden
        source = cross if self.cross else norm
        q = self.transpose(self.query(norm))
        k, v = self.transpose(self.key(source), key=True), self.transpose(self.value(source))
        scores = q @ k / math.sqrt(self.head_size)
        if self.causal and not self.cross:
            s = scores.shape[-1]
            scores = torch.where(torch.ones(s, s, dtype=torch.bool).tril(), scores,
                                 torch.tensor(-1e4))
        if mask is not None:
            scores = scores + mask
        context = (scores.softmax(-1) @ v).permute(0, 2, 1, 3)
        out = self.dense(context.reshape(*context.shape[:2], -1)) + hidden
        return self.layernorm(out) if self.layernorm else out


class RefOutput(nn.Module):
    def __init__(self, hidden, inter, activation, pre, post, eps=1e-5):
        super().__init__()
        self.dense1, self.dense2 = nn.Linear(hidden, inter), nn.Linear(inter, hidden)
        self.activation = activation
        self.pre_layernorm = nn.LayerNorm(hidden, eps=eps) if pre else None
        self.layernorm = nn.LayerNorm(hidden, eps=eps) if post else None

    def forward(self, inp):
        x = self.pre_layernorm(inp) if self.pre_layernorm else inp
        act = F.gelu if self.activation == "gelu" else F.relu
        out = self.dense2(act(self.dense1(x))) + inp
        return self.layernorm(out) if self.layernorm else out


class RefLayer(nn.Module):
    """The appendix ``TransformerLayer``, with SMP's layer-norm arrangement: with both pre
    and post layer norms the attention keeps only its pre-layernorm."""

    def __init__(self, heads, head_size, hidden, inter, activation, causal, pre, post, cross):
        super().__init__()
        att_post = post and not pre
        self.attention = RefAttention(heads, head_size, hidden, causal, pre, att_post)
        if cross:
            self.cross_attention = RefAttention(heads, head_size, hidden, causal, pre, att_post,
                                                cross=True)
        self.output = RefOutput(hidden, inter, activation, pre, post)
        self.cross = cross

    def forward(self, inp):
        if self.cross:
            hidden, cross_states, mask, cross_mask = inp
        else:
            hidden, mask = inp
        out = self.attention((hidden, mask))
        if self.cross:
            out = self.cross_attention((out, cross_states, cross_mask))
        out = self.output(out)
        return (out, cross_states, mask, cross_mask) if self.cross else (out, mask)


LAYER_CASES = [  # (activation, causal, pre, post, cross)
    ("gelu", False, False, True, False),  # SMP's defaults (BERT-like, post-LN)
    ("relu", True, True, False, False),  # pre-LN only
    ("gelu", True, True, True, False),  # both: GPT-2's last layer
    ("gelu", False, False, True, True),  # cross-attention (decoder of an encoder-decoder)
]


@pytest.mark.parametrize("activation, causal, pre, post, cross", LAYER_CASES)
def test_transformer_layer_equals_the_documented_reference(activation, causal, pre, post,
                                                           cross):
    torch.manual_seed(0)
    layer = smp_nn.DistributedTransformerLayer(
        num_attention_heads=4, attention_head_size=8, hidden_size=32, intermediate_size=64,
        attention_dropout_prob=0.0, hidden_dropout_prob=0.0, activation=activation,
        causal_mask_size=16 if causal else None, add_cross_attention=cross,
        pre_layernorm=pre, post_layernorm=post, use_normal_initialization=True)
    ref = RefLayer(4, 8, 32, 64, activation, causal, pre, post, cross)
    ref.load_state_dict(layer.state_dict())  # the same names: strict
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 10, 32, generator=g)
    mask = torch.zeros(3, 1, 1, 10)
    mask[1, ..., 7:] = -10000.0  # padded keys
    if cross:
        cross_states, cross_mask = torch.randn(3, 5, 32, generator=g), torch.zeros(3, 1, 1, 5)
        inp = (hidden, cross_states, mask, cross_mask)
    else:
        inp = (hidden, mask)
    got, want = layer(inp), ref(inp)
    assert len(got) == len(inp) and got[1] is inp[1]
    torch.testing.assert_close(got[0], want[0], **TOL)
    # the two halves on their own, as documented
    torch.testing.assert_close(layer.attention((hidden, mask)), ref.attention((hidden, mask)),
                               **TOL)
    torch.testing.assert_close(layer.output(hidden), ref.output(hidden), **TOL)


def test_transformer_stack_places_the_final_layer_norm_once():
    torch.manual_seed(0)
    kwargs = dict(num_attention_heads=2, attention_head_size=8, hidden_size=16,
                  intermediate_size=32, attention_dropout_prob=0.0, hidden_dropout_prob=0.0)
    stack = smp_nn.DistributedTransformer(num_layers=3, pre_layernorm=True, post_layernorm=True,
                                          **kwargs)
    post = [k for k in stack.state_dict() if ".layernorm." in k]
    assert post == ["seq_layers.2.output.layernorm.weight", "seq_layers.2.output.layernorm.bias"]
    x, mask = torch.randn(2, 5, 16), torch.zeros(2, 1, 1, 5)
    y = (x, mask)
    for layer in stack.seq_layers:
        y = layer(y)
    torch.testing.assert_close(stack((x, mask))[0], y[0])
    post_only = smp_nn.DistributedTransformer(num_layers=2, **kwargs)  # every layer post-LN
    assert sum(".layernorm.weight" in k for k in post_only.state_dict()) == 4


def test_linear_embedding_layer_norm_are_their_torch_modules():
    torch.manual_seed(0)
    linear = smp_nn.DistributedLinear(8, 4)
    x = torch.randn(3, 8)
    torch.testing.assert_close(linear(x), F.linear(x, linear.weight, linear.bias))
    emb = smp_nn.DistributedEmbedding(10, 6, padding_idx=0, initializer_range=0.5)
    assert emb.weight[0].abs().sum() == 0 and 0.3 < emb.weight[1:].std() < 0.7
    ids = torch.tensor([[0, 3, 9]])
    torch.testing.assert_close(emb(ids), emb.weight[ids])
    norm = smp_nn.FusedLayerNorm(6, eps=1e-6)
    torch.testing.assert_close(norm(emb(ids)), F.layer_norm(emb(ids), (6,), eps=1e-6))
    with pytest.raises(ValueError, match="max_norm"):
        smp_nn.DistributedEmbedding(10, 6, max_norm=1.0)
    distributed_norm = smp_nn.DistributedLayerNorm(6, eps=1e-6)  # replicated: torch's
    with torch.no_grad():
        distributed_norm.weight.uniform_(0.5, 1.5)
        distributed_norm.bias.uniform_(-1, 1)
    torch.testing.assert_close(distributed_norm(emb(ids)), F.layer_norm(
        emb(ids), (6,), distributed_norm.weight, distributed_norm.bias, eps=1e-6))


def test_output_layer_on_its_own_and_the_distributed_module_base():
    torch.manual_seed(0)
    mlp = smp_nn.DistributedTransformerOutputLayer(
        hidden_size=16, intermediate_size=32, hidden_dropout_prob=0.0, activation="relu",
        pre_layernorm=True, post_layernorm=False)
    ref = RefOutput(16, 32, "relu", pre=True, post=False)
    ref.load_state_dict(mlp.state_dict())  # the same names: strict
    hidden = torch.randn(2, 5, 16)
    torch.testing.assert_close(mlp(hidden), ref(hidden), **TOL)

    class Scale(smp_nn.DistributedModule):  # a user's own module on SMP's base class
        def __init__(self):
            super().__init__()
            self.factor = nn.Parameter(torch.tensor(3.0))

        def forward(self, x):
            return x * self.factor

    scale = Scale()
    assert torch.equal(scale(torch.ones(2)), torch.full((2,), 3.0))
    assert [n for n, _ in scale.named_parameters()] == ["factor"]
    assert Scale.can_distribute(4, hidden=8) is True  # SMP's hook: any arguments split
    assert scale.can_shard_activation_offloading() is False
    assert isinstance(mlp, smp_nn.DistributedModule)


def test_arguments_are_checked(caplog):
    with pytest.raises(ValueError, match="activation"):
        smp_nn.DistributedTransformerLayer(activation="tanh")
    with pytest.raises(ValueError, match="pre_layernorm and post_layernorm"):
        smp_nn.DistributedTransformer(num_layers=1, post_layernorm=False)
    with pytest.raises(ValueError, match="causal_mask_size"):
        smp_nn.DistributedTransformerLMHead(num_layers=1, num_positions=32, causal_mask_size=16)
    with pytest.raises(ValueError, match="ALiBi"):
        smp_nn.DistributedTransformerLayer(use_alibi=True)
    with pytest.raises(TypeError, match="no_such"):
        smp_nn.DistributedAttentionLayer(no_such=1)
    with caplog.at_level(logging.INFO, logger="modelparallel"):
        smp_nn.DistributedTransformerLayer(2, 8, 16, 32, fused_bias_gelu=True)
    assert "fused_bias_gelu=True): no effect here" in caplog.text
    layer = smp_nn.DistributedAttentionLayer(2, 8, 16, causal_mask_size=4)
    with pytest.raises(ValueError, match="exceeds causal_mask_size=4"):
        layer((torch.randn(1, 5, 16), None))


# -- SMP v1 LM head vs Hugging Face GPT-2, through SMP's translators ---------------------

def gpt2_pair(activation, monkeypatch, hf_gelu=True):
    import transformers as T

    cfg = T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                       activation_function=activation, resid_pdrop=0.0, embd_pdrop=0.0,
                       attn_pdrop=0.0, initializer_range=0.3)  # wide: GeLU variants differ
    torch.manual_seed(0)
    hf = T.GPT2LMHeadModel(cfg).eval()
    if activation == "gelu_new" and hf_gelu:
        monkeypatch.setenv("SMP_USE_HF_GELU", "1")  # SMP's switch to HF's tanh GeLU
    else:
        monkeypatch.delenv("SMP_USE_HF_GELU", raising=False)
    # the arguments SMP's GPT-2 init hook derives from the config
    args, kwargs = hf_gpt2.hf_gpt2_transformer_lm_head_init_hook(cfg)
    assert kwargs["pre_layernorm"] and kwargs["causal_mask_size"] == 16
    return hf, smp_nn.DistributedTransformerLMHead(*args, **kwargs).eval()


@pytest.mark.parametrize("activation", ["gelu_new", "relu"])
def test_gpt2_translators_round_trip_through_the_lm_head(activation, monkeypatch):
    pytest.importorskip("transformers")
    hf, smp = gpt2_pair(activation, monkeypatch)
    translated = hf_gpt2.translate_hf_state_dict_to_smdistributed_gpt2(hf.state_dict())
    smp.load_state_dict(translated)  # strict: every name and shape matches
    assert smp.lm_head.weight is smp.word_embedding.weight  # still tied
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(64, (3, 12), generator=g)
    types = torch.randint(64, (3, 12), generator=g)
    mask = torch.ones(3, 12)
    mask[1, 9:] = 0  # right padding
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=ids)
        loss, logits = smp((ids, mask, types, None, ids))
        plain = smp((ids, None, None, None, None))
        want_plain = hf(input_ids=ids).logits
    torch.testing.assert_close(logits, want.logits, **TOL)
    torch.testing.assert_close(loss, want.loss, **TOL)
    torch.testing.assert_close(plain, want_plain, **TOL)
    # SMP's forward and return hooks: GPT2LMHeadModel's call, answered by the LM head
    _, forward_hook, return_hook = hf_gpt2.get_hf_gpt2_transformer_lm_head_hooks()
    call_args, call_kwargs = forward_hook(input_ids=ids, attention_mask=mask, labels=ids,
                                          token_type_ids=types, return_dict=True)
    with torch.no_grad():
        out = return_hook(smp(*call_args, **call_kwargs))
    torch.testing.assert_close(out.loss, want.loss, **TOL)
    torch.testing.assert_close(out.logits, want.logits, **TOL)
    with pytest.raises(ValueError, match="use_cache"):
        forward_hook(input_ids=ids, use_cache=True)
    if activation == "gelu_new":  # SMP's exact GeLU without its switch: not GPT-2's
        _, exact = gpt2_pair("gelu_new", monkeypatch, hf_gelu=False)
        exact.load_state_dict(translated)
        with torch.no_grad():
            assert (exact((ids, None, None, None, None)) - want_plain).abs().max() > 1e-4
    back = hf_gpt2.translate_state_dict_to_hf_gpt2(smp.state_dict(), max_seq_len=16)
    assert set(back) == set(hf.state_dict())
    for name, value in hf.state_dict().items():
        assert torch.equal(back[name], value), name
    # already in the target's names (a GPT-2 split in place keeps Hugging Face's): as is
    assert hf_gpt2.translate_state_dict_to_hf_gpt2(back).keys() == back.keys()
    assert hf_gpt2.translate_hf_state_dict_to_smdistributed_gpt2(translated) == translated


def test_gpt2_layer_translators_round_trip():
    pytest.importorskip("transformers")
    import transformers as T

    hf = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                        n_positions=16))
    layered = hf_gpt2.translate_hf_state_dict_to_smdistributed_gpt2_layer(hf.state_dict())
    assert "transformer.h.1.attention.query.weight" in layered
    assert layered["transformer.h.0.output.dense1.weight"].shape == (128, 32)
    back = hf_gpt2.translate_state_dict_to_hf_gpt2_layer(layered)
    assert set(back) == set(hf.state_dict())
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
    with pytest.raises(ValueError, match="unknown parameter"):
        hf_gpt2.translate_state_dict_to_hf_gpt2({"pooler.weight": torch.zeros(1)})


# -- SMP v2: torch.sagemaker.tensor_parallel.transformer --------------------------------

def test_transformer_lm_head_is_a_causal_lm_with_hf_style_outputs():
    torch.manual_seed(0)
    args = dict(num_layers=2, num_attention_heads=4, attention_head_size=8, hidden_size=32,
                intermediate_size=64, vocab_size=64, num_positions=16,
                attention_dropout_prob=0.0, hidden_dropout_prob=0.0)
    model = TransformerLMHead(**args)
    v1 = smp_nn.DistributedTransformerLMHead(**args, pre_layernorm=True, post_layernorm=True,
                                             causal_mask_size=16)
    v1.load_state_dict(model.state_dict())
    ids = torch.randint(64, (2, 10))
    out = model(input_ids=ids, attention_mask=None, labels=ids)
    loss, logits = v1((ids, None, None, None, ids))
    torch.testing.assert_close(out["loss"], loss)
    torch.testing.assert_close(out.logits, logits)
    assert model(ids).loss is None
    post_only = TransformerLMHead(**{**args, "num_layers": 1}, pre_layernorm=False)
    assert not any("pre_layernorm" in k for k in post_only.state_dict())
    assert post_only.transformer.seq_layers[0].attention.causal_mask_size == 16
    # causal: the logits of a prefix do not depend on what follows it
    torch.testing.assert_close(model(ids[:, :4]).logits, out.logits[:, :4], **TOL)


def test_transformer_layer_classes_match_the_layers_transform_splits():
    import transformers as T

    from modelparallel.models.gpt import Block, GPTConfig

    llama = T.models.llama.modeling_llama.LlamaDecoderLayer(
        T.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2), 0)
    for cls in (TransformerLayer, TETransformerLayer):
        assert isinstance(llama, cls) and isinstance(Block(GPTConfig(d_model=32)), cls)
        assert isinstance(smp_nn.DistributedTransformerLayer(2, 8, 16, 32), cls)
        assert not isinstance(nn.Linear(2, 2), cls)
    assert isinstance(TransformerLayer(2, 8, 16, 32), smp_nn.DistributedTransformerLayer)
    assert not isinstance(llama, smp_nn.DistributedTransformerLayer)  # only the SMP v2 names
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy  # as scripts use it

    assert transformer_auto_wrap_policy(llama, recurse=False, nonwrapped_numel=0,
                                        transformer_layer_cls={TETransformerLayer})
    with pytest.raises(TypeError, match="TransformerEngine"):
        TETransformerLayer()


# -- tensor-parallel plans ------------------------------------------------------------------

def test_plans_split_heads_widths_and_vocabulary():
    model = nn.ModuleDict({
        "lm": smp_nn.DistributedTransformerLMHead(num_layers=1, num_attention_heads=4,
                                                  attention_head_size=8, hidden_size=32,
                                                  intermediate_size=64, vocab_size=64,
                                                  num_positions=16),
        "linear": smp_nn.DistributedLinear(8, 3), "emb": smp_nn.DistributedEmbedding(5, 6)})
    found = {f.path: sorted(f.plan.styles) for f in find_plans(model, TPOptions(2))}
    assert found == {
        "lm": ["lm_head", "word_embedding"],
        "lm.transformer.seq_layers.0.attention": ["dense", "key", "query", "value"],
        "lm.transformer.seq_layers.0.output": ["dense1", "dense2"],
        "linear": [""], "emb": [""]}
    odd = smp_nn.DistributedTransformerLayer(num_attention_heads=3, attention_head_size=8,
                                             hidden_size=24, intermediate_size=48)
    with pytest.raises(ConfigError, match="attention heads = 3 is not divisible"):
        find_plans(odd, TPOptions(2))
