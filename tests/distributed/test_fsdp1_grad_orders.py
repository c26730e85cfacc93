"""FSDP1 over a tensor-parallel model whose shard groups have one rank (tp 2 on 2 ranks,
the common TP-only setup) trains as one process in every order of ``zero_grad``,
forward, backward and step, and when it accumulates gradients.

Each case runs an SMP v2 script (``mp.transform``, then FSDP1 as torch's examples wrap
it) for 3 SGD-with-momentum steps in one order and compares the loss of every step,
every parameter and every momentum buffer at the end with one process running the same
order: ``zero_grad`` first, between forward and backward (PyTorch's examples), or
after the step, each with ``set_to_none`` True and False; no ``zero_grad`` at all
(gradients accumulate over steps); two backward passes per step; the same inside
``no_sync()``. Each with ``use_orig_params`` True and False.
"""

import contextlib
import functools

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import modelparallel as mp
from modelparallel.models import GPT, GPTConfig
from modelparallel.models.gpt import Block, lm_loss
from modelparallel.testing import TrainResult, full_parameters, parity_problems, token_batches

CFG = GPTConfig(vocab_size=64, max_seq_len=8, d_model=32, n_layers=2, n_heads=4)
ORDERS = ["first", "between", "after", "first-zeros", "between-zeros", "after-zeros",
          "never", "accumulate", "no_sync"]


def build() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def batches():
    return token_batches(3, 4, CFG.max_seq_len, CFG.vocab_size, seed=1)


def sgd(model) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def train(model, opt: torch.optim.Optimizer, order: str) -> list[float]:
    """Three steps in ``order``; the loss of each (a tensor-parallel model's batch is
    its whole group's: both ranks see the global batch)."""
    none = not order.endswith("-zeros")
    losses = []
    for x, y in batches():
        if order in ("accumulate", "no_sync"):
            opt.zero_grad()
            total = 0.0
            for half in (slice(0, 2), slice(2, 4)):
                skip = order == "no_sync" and half.start == 0
                with model.no_sync() if skip and hasattr(model, "no_sync") else \
                        contextlib.nullcontext():
                    loss = lm_loss(model(x[half]), y[half]) / 2
                    loss.backward()
                total += loss.item()
            opt.step()
            losses.append(total)
            continue
        if order.startswith("first"):
            opt.zero_grad(set_to_none=none)
        loss = lm_loss(model(x), y)
        if order.startswith("between"):
            opt.zero_grad(set_to_none=none)
        loss.backward()
        opt.step()
        if order.startswith("after"):
            opt.zero_grad(set_to_none=none)
        losses.append(loss.item())
    return losses


def momentum(model, opt) -> dict[str, torch.Tensor]:
    """Every momentum buffer, whole, by parameter name."""
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {name: state["momentum_buffer"].detach().cpu().clone()
            for name, state in osd["state"].items() if "momentum_buffer" in state}


@functools.cache
def reference(order: str) -> tuple[TrainResult, dict[str, torch.Tensor]]:
    model = build()
    opt = sgd(model)
    losses = train(model, opt, order)
    return TrainResult(losses, full_parameters(model)), momentum(model, opt)


def order_case(order: str, use_orig_params: bool):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    mp.init({"tensor_parallel_degree": 2})
    model = FSDP(mp.transform(build()), auto_wrap_policy=ModuleWrapPolicy({Block}),
                 use_orig_params=use_orig_params)
    opt = sgd(model)
    losses = train(model, opt, order)
    return TrainResult(losses, full_parameters(model)), momentum(model, opt)


@pytest.mark.parametrize("use_orig_params", [True, False], ids=["orig-params", "flat-params"])
@pytest.mark.parametrize("order", ORDERS)
def test_every_order_trains_as_one_process(workers, order, use_orig_params):
    want, want_momentum = reference(order)
    for result, buffers in workers(2).run(order_case, order=order,
                                          use_orig_params=use_orig_params):
        assert parity_problems(result, want) == []
        assert sorted(buffers) == sorted(want_momentum)
        for name, buffer in buffers.items():  # parity_problems' rule for a tensor
            ref = want_momentum[name]
            assert (buffer - ref).abs().max() <= 1e-5 * ref.abs().max() + 1e-8, name


def test_the_orders_differ():
    """The orders are not one computation: accumulating over steps changes the result."""
    assert reference("never")[0].losses != reference("first")[0].losses
