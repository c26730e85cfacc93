"""Tensor parallelism in real processes: errors, custom modules, random numbers, state dicts."""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_tensor_parallel import HF, Logits, batches, build, reference, sgd
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import modelparallel as mp
from modelparallel.models import GPT, GPTConfig
from modelparallel.models.gpt import lm_loss
from modelparallel.testing import WorkerError, assert_parity, train
from modelparallel.testing.parity import TrainResult

TP2 = {"tensor_parallel_degree": 2}


def bad_heads_case():
    mp.init(TP2)
    mp.transform(GPT(GPTConfig(vocab_size=64, d_model=48, n_heads=3, n_layers=1)))


def test_indivisible_model_fails_on_every_rank_before_any_split(workers):
    with pytest.raises(WorkerError) as err:
        workers(2).run(bad_heads_case)
    msg = str(err.value)
    assert "failed on 2 ranks" in msg
    assert "attention heads = 3 is not divisible by tensor_parallel_degree=2" in msg
    assert "allows tensor_parallel_degree in [1]" in msg


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def unsplit_case():
    mp.init(TP2)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = mp.transform(Toy())
    split = any(isinstance(p, DTensor) for p in model.parameters())
    return split, [str(w.message) for w in caught
                   if issubclass(w.category, mp.parallel.tensor.UnsplitModelWarning)]


def test_model_without_plan_is_left_whole_with_one_warning(workers):
    (split0, warned0), (split1, warned1) = workers(2).run(unsplit_case)
    assert not split0 and not split1
    assert len(warned0) == 1 and warned1 == []  # said once, by rank 0
    assert "no module of Toy has a tensor-parallel plan (modules with parameters: Linear, Toy)" \
        not in warned0[0]  # Toy holds no parameters itself
    assert "no module of Toy has a tensor-parallel plan (modules with parameters: Linear)" \
        in warned0[0]
    assert "mp.tp_register_with_module" in warned0[0]


def toy_batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)) for _ in range(5)]


def registered_case(how: str):
    mp.init(TP2)
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    torch.manual_seed(0)
    ref = train(Toy(), toy_batches(), optimizer=sgd, loss_fn=F.mse_loss)
    torch.manual_seed(0)
    if how == "register":
        mp.tp_register_with_module(Toy, plan)
        model = Toy()
    else:  # SMP v1: modules created inside the context are split when they can be
        with mp.tensor_parallelism():
            model = Toy()
    try:
        mp.transform(model)
    finally:
        mp.parallel.tensor.plans.unregister(Toy)
    assert isinstance(model.up.weight, DTensor) and isinstance(model.down.weight, DTensor)
    # each TP rank trains on its own rows, as a data-parallel rank would
    assert_parity(train(model, toy_batches(), optimizer=sgd, loss_fn=F.mse_loss,
                        replica=(mp.dp_rank(), mp.dp_size()), group=mp.get_dp_process_group()),
                  ref)


@pytest.mark.parametrize("how", ["register", "context"])
def test_custom_module_parity(workers, how):
    workers(2).run(registered_case, how=how)


def rng_case(seed: int):
    """Random draws inside the sharded (attention) and replicated (MLP) regions."""
    mp.init({**TP2, "random_seed": seed})
    torch.manual_seed(0)
    model = mp.transform(GPT(GPTConfig(vocab_size=64, max_seq_len=16, d_model=32, n_layers=1,
                                       n_heads=4, dropout=0.5)))
    draws = {}

    def draw(key):
        def hook(module, args):
            draws.setdefault(key, torch.rand(4))
        return hook

    def dropped(module, args, out):
        draws.setdefault("mlp_dropout_zeros", (out == 0).float())

    model.blocks[0].attn.q_proj.register_forward_pre_hook(draw("sharded"))
    model.blocks[0].mlp.fc_in.register_forward_pre_hook(draw("replicated"))
    model.blocks[0].mlp.dropout.register_forward_hook(dropped)
    x = torch.randint(64, (2, 16))
    optimizer = sgd(model)
    for _ in range(3):  # replicated parameters must stay identical over TP ranks
        optimizer.zero_grad()
        model(x).float().pow(2).mean().backward()
        optimizer.step()
    draws["ln_1"] = model.blocks[0].ln_1.weight.detach().clone()
    return draws


def test_dropout_differs_where_sharded_and_matches_where_replicated(workers):
    r0, r1 = workers(2).run(rng_case, seed=7)
    assert not torch.equal(r0["sharded"], r1["sharded"])
    assert torch.equal(r0["replicated"], r1["replicated"])
    assert torch.equal(r0["mlp_dropout_zeros"], r1["mlp_dropout_zeros"])
    assert 0 < r0["mlp_dropout_zeros"].mean() < 1
    assert torch.equal(r0["ln_1"], r1["ln_1"])
    other, _ = workers(2).run(rng_case, seed=8)  # random_seed picks the sharded stream
    assert not torch.equal(other["sharded"], r0["sharded"])
    assert torch.equal(other["replicated"], r0["replicated"])


def load_full_case(arch: str, config: dict):
    """A full single-device state dict loaded into a split model: same weights, same logits."""
    mp.init({**config, "prescaled_batch": True})
    trained = reference(arch)
    model = mp.transform(build(arch))
    if config.get("hybrid_shard_degree"):
        mp.shard(model)
    wrap = Logits if arch in HF else (lambda m: m)  # the reference's names
    model = wrap(model)
    mp.load_full_state_dict(model, trained.params)
    back = mp.full_state_dict(model, cpu_offload=False)
    assert set(back) == set(trained.params)
    for name, value in trained.params.items():
        assert torch.equal(back[name].cpu(), value), name
    single = wrap(build(arch))
    single.load_state_dict(trained.params)
    inputs = batches(arch)[0][0]
    torch.testing.assert_close(model(inputs), single(inputs), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch, world, config", [
    ("gpt", 4, {**TP2, "hybrid_shard_degree": 2}),
    ("gpt2", 4, {**TP2, "hybrid_shard_degree": 2}),  # the fused q|k|v projection
    ("llama", 2, TP2),
])
def test_load_full_state_dict_into_split_model(workers, arch, world, config):
    if arch in HF:
        pytest.importorskip("transformers")
    workers(world).run(load_full_case, arch=arch, config=config)


def pretrained_case(arch: str, path: str):
    """Train split, consolidate, save_pretrained, from_pretrained: the reference weights."""
    mp.init({**TP2, "prescaled_batch": True})
    model = mp.transform(build(arch))
    train(Logits(model), batches(arch), optimizer=sgd, loss_fn=lm_loss)
    full = mp.full_state_dict(model)  # rank 0 only (cpu_offload)
    try:
        if mp.rank() == 0:
            single = build(arch)
            single.load_state_dict(full)
            single.save_pretrained(path)
            loaded = type(single).from_pretrained(path)
            params = {f"model.{k}": v.detach() for k, v in loaded.state_dict().items()}
            assert_parity(TrainResult(reference(arch).losses, params), reference(arch))
    finally:
        dist.barrier()  # rank 1 waits for rank 0's check, pass or fail


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_full_state_dict_loads_with_from_pretrained(workers, tmp_path, arch):
    pytest.importorskip("transformers")
    workers(2).run(pretrained_case, arch=arch, path=str(tmp_path / arch))


def own_batch_case(prescaled: bool, rows: int = 2, loss_parallel: bool = False):
    """Each TP rank passes its own batch (different data, ``rows`` rows on rank 0)."""
    mp.init({**TP2, "prescaled_batch": prescaled})
    torch.manual_seed(0)
    model = mp.transform(GPT(GPTConfig(vocab_size=64, max_seq_len=16, d_model=32, n_layers=1,
                                       n_heads=4)), loss_parallel=loss_parallel)
    g = torch.Generator().manual_seed(mp.rank())
    inputs = torch.randint(64, (rows if mp.rank() == 0 else 2, 16), generator=g)
    return tuple(model(inputs).shape)


def test_own_batches_with_prescaled_batch_are_an_error_not_a_wrong_result(workers):
    with pytest.raises(WorkerError) as err:
        workers(2).run(own_batch_case, prescaled=True)
    assert "failed on 2 ranks" in str(err.value)
    assert "DifferentBatchError" in str(err.value)
    assert "shard your data by mp.rdp_rank()" in str(err.value)


def test_own_batches_of_different_sizes_are_an_error_on_every_rank(workers):
    assert workers(2).run(own_batch_case, prescaled=False) == [(2, 16, 64)] * 2
    with pytest.raises(WorkerError) as err:
        workers(2).run(own_batch_case, prescaled=False, rows=3)
    assert "failed on 2 ranks" in str(err.value)
    assert "passed batches of [3, 2] rows" in str(err.value)
    assert "drop_last=True" in str(err.value)


def test_loss_parallel_needs_prescaled_batch(workers):
    with pytest.raises(WorkerError) as err:
        workers(2).run(own_batch_case, prescaled=False, loss_parallel=True)
    assert "failed on 2 ranks" in str(err.value)
    assert "prescaled_batch: loss_parallel=True keeps the logits split" in str(err.value)


def hf_labels_case():
    """A Hugging Face model called with keyword inputs that computes its own loss."""
    mp.init(TP2)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(64, (4, 16), generator=g)
    single = build("llama")
    expected = single(input_ids=ids, labels=ids)
    expected.loss.backward()
    model = mp.transform(build("llama"))
    mine = ids[2 * mp.rank():2 * mp.rank() + 2]  # this rank's own batch
    out = model(input_ids=mine, labels=mine, attention_mask=torch.ones_like(mine))
    out.loss.backward()
    # the loss is the TP group's (both batches); the logits are this rank's rows
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(out.logits, expected.logits[2 * mp.rank():][:2], rtol=1e-5,
                               atol=1e-6)
    for (name, p), ref in zip(model.named_parameters(), single.parameters(), strict=True):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad.reshape(ref.shape), ref.grad, rtol=1e-4, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_hf_keyword_inputs_and_internal_loss_with_own_batches(workers):
    pytest.importorskip("transformers")
    workers(2).run(hf_labels_case)
