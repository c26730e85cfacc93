"""An optimizer holding parameters the model no longer trains is refused at its first step.

``mp.transform``, ``mp.shard``, FSDP1 with flat parameters and ``DistributedModel``'s
first step replace the model's parameters; an optimizer built before them steps the old
tensors and the model never changes. Each case builds the optimizer too early and checks
that its first ``step()`` raises, on every rank alike, one line naming what replaced the
parameters and what to do, before the model changed. Optimizers built where the
parameters survive train as one process (losses of every step and every parameter at
the end compared): before ``mp.replicate`` (DDP keeps them), before FSDP1 with
``use_orig_params=True``, and an SMP v1 ``DistributedOptimizer`` built before the first
step (it follows the split).
"""

import functools

import pytest
import torch

import modelparallel as mp
from modelparallel.models import GPT, GPTConfig
from modelparallel.models.gpt import Block, lm_loss
from modelparallel.testing import TrainResult, full_parameters, parity_problems, token_batches

CFG = GPTConfig(vocab_size=64, max_seq_len=8, d_model=32, n_layers=2, n_heads=4)


def build() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def batches():
    return token_batches(3, 4, CFG.max_seq_len, CFG.vocab_size, seed=1)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _steps(model, opt, rows: slice = slice(None)) -> list[float]:
    losses = []
    for x, y in batches():
        opt.zero_grad()
        loss = lm_loss(model(x[rows]), y[rows])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@functools.cache
def reference() -> TrainResult:
    model = build()
    losses = _steps(model, sgd(model.parameters()))
    return TrainResult(losses, full_parameters(model))


def _fsdp1(model, use_orig_params: bool):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                use_orig_params=use_orig_params)


WRAPS = {
    "transform": ({"tensor_parallel_degree": 2}, mp.transform),
    "shard": ({}, mp.shard),
    "fsdp1-flat": ({"hybrid_shard_degree": 2}, functools.partial(_fsdp1,
                                                                 use_orig_params=False)),
}


def too_early_case(wrap: str) -> tuple[str, bool]:
    """The refusal's text, and whether the model was left as it was."""
    config, apply = WRAPS[wrap]
    mp.init(config)
    model = build()
    opt = sgd(model.parameters())  # before the model is wrapped
    model = apply(model)
    before = full_parameters(model)
    x, y = batches()[0]
    lm_loss(model(x), y).backward()
    try:
        opt.step()
    except RuntimeError as e:
        after = full_parameters(model)
        return str(e), all(torch.equal(before[k], after[k]) for k in before)
    return "", False


@pytest.mark.parametrize("wrap, by", [("transform", "mp.transform()"), ("shard", "mp.shard()"),
                                      ("fsdp1-flat", "FullyShardedDataParallel")])
def test_an_optimizer_built_before_the_wrap_is_refused(workers, wrap, by):
    (message, unchanged), other = workers(2).run(too_early_case, wrap=wrap)
    assert other == (message, unchanged)
    assert f"that {by} replaced" in message and "\n" not in message
    assert f"build the optimizer after {by}" in message
    assert unchanged


def v1_case(wrapped: bool) -> str | list[float]:
    """SMP v1 under tp 2: a torch optimizer over the model's parameters built before the
    first step, used as it is (refused) or through mp.DistributedOptimizer (trains)."""
    mp.init({"tensor_parallel_degree": 2})
    model = mp.DistributedModel(build())
    torch_opt = sgd(model.parameters())
    opt = mp.DistributedOptimizer(torch_opt) if wrapped else torch_opt

    @mp.step
    def train_step(model, x, y):
        loss = lm_loss(model(x), y)
        model.backward(loss)
        return loss

    losses = []
    try:
        for x, y in batches():
            opt.zero_grad()
            losses.append(train_step(model, x, y).reduce_mean().item())
            opt.step()
    except RuntimeError as e:
        return str(e)
    return losses


def test_distributed_model_refuses_a_plain_optimizer_built_before_the_split(workers):
    first, second = workers(2).run(v1_case, wrapped=False)
    assert first == second and "\n" not in first
    assert "mp.DistributedModel's first step replaced" in first
    assert "mp.DistributedOptimizer" in first


def test_distributed_optimizer_built_before_the_split_trains(workers):
    for losses in workers(2).run(v1_case, wrapped=True):
        assert losses == pytest.approx(reference().losses, rel=1e-5)


def kept_case(wrap: str) -> TrainResult:
    mp.init({"hybrid_shard_degree": 1} if wrap == "replicate" else {"hybrid_shard_degree": 2})
    model = build()
    opt = sgd(model.parameters())  # before the wrap, which keeps these parameters
    model = mp.replicate(model) if wrap == "replicate" else _fsdp1(model, True)
    rank, size = mp.rdp_rank(), mp.rdp_size()
    rows = slice(rank * 4 // size, (rank + 1) * 4 // size)
    losses = _steps(model, opt, rows)
    import torch.distributed as dist
    averaged = []
    for loss in losses:
        value = torch.tensor(loss, dtype=torch.float64)
        dist.all_reduce(value, group=mp.get_rdp_process_group())
        averaged.append(float(value) / size)
    return TrainResult(averaged, full_parameters(model))


@pytest.mark.parametrize("wrap", ["replicate", "fsdp1-orig-params"])
def test_an_optimizer_over_kept_parameters_trains(workers, wrap):
    for result in workers(2).run(kept_case, wrap=wrap):
        assert parity_problems(result, reference()) == []
