"""Tensor-parallel plans: lookup, registration, and every validation error (no processes)."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import modelparallel as mp
from modelparallel.config import ConfigError
from modelparallel.models import GPT, GPTConfig, ViT, ViTConfig
from modelparallel.parallel.tensor.plans import TPOptions, plan_for, unregister
from modelparallel.parallel.tensor.transform import find_plans


def gpt(**overrides) -> GPT:
    cfg = dict(vocab_size=64, max_seq_len=16, d_model=32, n_layers=2, n_heads=4)
    return GPT(GPTConfig(**{**cfg, **overrides}))


def problems(model: nn.Module, degree: int, **options) -> str:
    with pytest.raises(ConfigError) as err:
        find_plans(model, TPOptions(degree, **options))
    return str(err.value)


def test_reference_models_have_plans_for_root_and_every_block():
    found = find_plans(gpt(), TPOptions(2))
    assert [f.path for f in found] == ["", "blocks.0", "blocks.1"]
    # "attn" itself: q, k and v share one DTensor input, so its gradient is reduced once
    assert set(found[1].plan.styles) == {"attn", "attn.q_proj", "attn.k_proj", "attn.v_proj",
                                        "attn.o_proj", "mlp.fc_in", "mlp.fc_out"}
    assert [f.path for f in find_plans(ViT(ViTConfig(n_layers=2)), TPOptions(2))] == \
        ["", "blocks.0", "blocks.1"]


def test_heads_not_divisible():
    msg = problems(gpt(n_heads=2, d_model=32, vocab_size=64), 4)
    assert "blocks.0 (Block): attention heads = 2 is not divisible by tensor_parallel_degree=4" \
        in msg
    assert "this model allows tensor_parallel_degree in [1, 2]" in msg  # too large a degree


def test_mlp_width_and_vocabulary_not_divisible():
    msg = problems(gpt(d_ff=33, vocab_size=63, n_heads=2), 2)
    assert "blocks.1 (Block): MLP width = 33 is not divisible by tensor_parallel_degree=2" in msg
    assert "model (GPT): vocabulary = 63 is not divisible by tensor_parallel_degree=2" in msg
    assert "allows tensor_parallel_degree in [1]" in msg


def test_sequence_parallel_needs_divisible_positions():
    msg = problems(gpt(max_seq_len=15), 2, sequence_parallel=True)
    assert "positions = 15 is not divisible by tensor_parallel_degree=2" in msg


def test_every_rank_sees_all_problems_at_once():
    with pytest.raises(ConfigError) as err:
        find_plans(gpt(n_heads=2, d_ff=33, vocab_size=63), TPOptions(4))
    # heads and MLP width of 2 blocks, the vocabulary, and the hint of what would work
    assert err.value.keys == ["tensor_parallel_degree"] * (2 * 2 + 1 + 1)


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers")


def test_kv_heads_not_divisible(transformers):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=1)
    msg = problems(transformers.LlamaForCausalLM(cfg), 2)
    assert ("model.layers.0 (LlamaDecoderLayer): key/value heads = 1 is not divisible by "
            "tensor_parallel_degree=2") in msg
    assert "attention heads" not in msg


def test_hugging_face_plans_are_found(transformers):
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4)
    found = find_plans(transformers.GPT2LMHeadModel(cfg), TPOptions(2))
    assert [f.path for f in found] == ["", "transformer", "transformer.h.0", "transformer.h.1"]


def test_sequence_parallel_unsupported_plan_is_named(transformers):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4)
    with pytest.raises(ConfigError) as err:
        find_plans(transformers.LlamaForCausalLM(cfg), TPOptions(2, sequence_parallel=True))
    assert err.value.keys == ["sequence_parallel"] * 3
    assert "model.layers.0 (LlamaDecoderLayer): its tensor-parallel plan does not support " \
        "sequence parallelism" in str(err.value)


def test_gpt2_cross_attention_is_rejected(transformers):
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4,
                                  add_cross_attention=True)
    msg = problems(transformers.GPT2LMHeadModel(cfg), 2)
    assert "GPT-2 with cross-attention" in msg


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_unknown_model_has_no_plan():
    assert find_plans(Toy(), TPOptions(2)) == []


def test_registered_plan_is_used_and_validated():
    mp.tp_register_with_module(Toy, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    try:
        found = find_plans(nn.Sequential(Toy()), TPOptions(2))
        assert [f.path for f in found] == ["0"]
        assert set(found[0].plan.styles) == {"up", "down"}
    finally:
        unregister(Toy)
    assert plan_for(Toy(), TPOptions(2)) is None


def test_registered_factory_gets_module_and_options():
    seen = []

    def factory(module, options):
        seen.append((type(module).__name__, options.degree))
        return mp.TPPlan(styles={"up": ColwiseParallel(), "down": RowwiseParallel()},
                         sizes={"hidden": module.up.out_features})

    mp.tp_register_with_module(Toy, factory)
    try:
        assert "hidden = 16 is not divisible by tensor_parallel_degree=3" in problems(Toy(), 3)
        assert seen == [("Toy", 3)]
    finally:
        unregister(Toy)


def test_registration_rejects_non_modules():
    with pytest.raises(TypeError, match=r"nn\.Module subclass"):
        mp.tp_register_with_module(int, {})


def test_tensor_parallelism_context_marks_modules_created_inside():
    with mp.tensor_parallelism():
        inside = nn.Linear(4, 8)
    outside = nn.Linear(4, 8)
    model = nn.Sequential(inside, outside)
    found = find_plans(model, TPOptions(2))
    assert [f.path for f in found] == ["0"]  # a lone Linear: column-parallel, gathered output
    assert plan_for(outside, TPOptions(2)) is None


def test_set_tensor_parallelism_false_keeps_a_subtree_whole():
    model = gpt()
    mp.set_tensor_parallelism(model.blocks[1], False)
    assert [f.path for f in find_plans(model, TPOptions(2))] == ["", "blocks.0"]
    # A disabled module's sizes are not checked either.
    model = gpt(n_layers=1, n_heads=2)
    mp.set_tensor_parallelism(model.blocks[0], False)
    assert [f.path for f in find_plans(model, TPOptions(4))] == [""]
