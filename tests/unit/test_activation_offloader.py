"""The activation offloader in one process: the horizon, parity, torch's offload_wrapper
routed to it, the notice when nothing is checkpointed, and what it relies on in torch.

The horizon is measured from outside the offloader: a gradient hook on every layer's
output fires just before backward reaches that layer, and asks how many layers' saved
inputs have copies on the device at that moment (counted from the saved tensors).
"""

import functools
import gc
import logging

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    OffloadWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)

import modelparallel as mp
from modelparallel.models import GPT, GPTConfig
from modelparallel.models.gpt import Block, lm_loss
from modelparallel.parallel.activation import apply_activation_checkpointing as apply_marks
from modelparallel.parallel.offload import ActivationOffloader, loading_horizon
from modelparallel.parallel.offload_roots import (
    offload_checkpointed,
    offloader_of,
    route_offload_wrapper,
)
from modelparallel.parallel.offload_torch import TORCH_OFFLOAD_FORWARD, wrapped_module
from modelparallel.testing import assert_parity, token_batches, train

LAYERS, STEPS = 4, 3
CFG = GPTConfig(vocab_size=64, max_seq_len=16, d_model=32, n_layers=LAYERS, n_heads=2)


def build() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def batches():
    return token_batches(STEPS, 8, CFG.max_seq_len, CFG.vocab_size, seed=1)


@functools.cache
def reference():
    return train(build(), batches(), optimizer=sgd, loss_fn=lm_loss)


def marked(horizon: int) -> tuple[GPT, ActivationOffloader]:
    """SMP v1: blocks marked for checkpointing, their inputs offloaded."""
    model = build()
    mp.set_activation_checkpointing(model.blocks)
    apply_marks(model)
    offloader = offload_checkpointed(model, "cpu", horizon)
    assert offloader is not None
    return model, offloader


def sample_residency(model: GPT, offloader: ActivationOffloader):
    """Residency seen when each block's forward ends and just before its backward."""
    forward: list[int] = []
    backward: list[int] = []

    def hook(module, args, out):
        forward.append(offloader.resident_layers())
        if out.requires_grad:
            out.register_hook(lambda grad: backward.append(offloader.resident_layers()))

    for block in model.blocks:
        block.register_forward_hook(hook)
    return forward, backward


@pytest.fixture
def torch_forward_restored():
    before = OffloadWrapper.forward
    yield
    OffloadWrapper.forward = before


@pytest.mark.parametrize("horizon", [1, 2, 6])
def test_at_most_horizon_layers_resident_during_backward(horizon):
    model, offloader = marked(horizon)
    forward, backward = sample_residency(model, offloader)
    result = train(model, batches(), optimizer=sgd, loss_fn=lm_loss)
    assert_parity(result, reference())
    assert len(backward) == STEPS * LAYERS
    assert forward == [0] * (STEPS * LAYERS)  # every layer's inputs went to CPU in forward
    assert max(backward) == min(horizon, LAYERS)  # prefetched up to the horizon, no more
    # per step, backward meets the layers last to first: full up to the horizon, then
    # what is left to fetch
    per_step = [min(horizon, LAYERS - i) for i in range(LAYERS)]
    assert backward == per_step * STEPS
    assert offloader.stats.layers_offloaded == STEPS * LAYERS
    assert offloader.stats.fetched_on_demand == 0 and offloader.stats.evicted == 0


def test_backward_order_other_than_forward_fetches_on_demand_within_the_horizon():
    """Two forwards, then backward of the second first (as pipeline schedules may): the
    first's prefetched layers are sent back to make room; gradients are unchanged."""
    model, offloader = marked(2)
    plain = build()
    _, backward = sample_residency(model, offloader)
    (x1, y1), (x2, y2) = batches()[:2]
    first, second = lm_loss(model(x1), y1), lm_loss(model(x2), y2)
    second.backward()
    first.backward()
    (lm_loss(plain(x2), y2) + lm_loss(plain(x1), y1)).backward()
    assert max(backward) == 2 and offloader.stats.max_resident == 2
    assert offloader.stats.evicted >= 1 and offloader.stats.fetched_on_demand >= 1
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_a_second_backward_over_the_same_graph_fetches_again():
    model, offloader = marked(1)
    plain = build()
    x, y = batches()[0]
    loss = lm_loss(model(x), y)
    loss.backward(retain_graph=True)
    loss.backward()
    (2 * lm_loss(plain(x), y)).backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    assert offloader.resident_layers() == 0


@pytest.mark.parametrize("impl", [CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT])
def test_torch_offload_wrapper_runs_the_offloader(torch_forward_restored, impl):
    """SMP v2's script order: torch's checkpoint_wrapper on the blocks, offload_wrapper on
    the root; with settings, the wrapper offloads and prefetches within the horizon."""
    route_offload_wrapper(lambda: (torch.device("cpu"), 2))
    model = build()
    apply_activation_checkpointing(
        model, check_fn=lambda m: isinstance(m, Block),
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl))
    model = offload_wrapper(model)
    result = train(model, batches(), optimizer=sgd, loss_fn=lm_loss)
    assert_parity(result, reference())
    offloader = offloader_of(model)
    assert offloader is not None and offloader.horizon == 2
    assert offloader.stats.layers_offloaded == STEPS * LAYERS
    assert offloader.stats.max_resident == 2
    # everything else the root's forward saved went to CPU too, as torch's wrapper does
    assert offloader.stats.tensors_offloaded > STEPS * LAYERS


def test_torch_offload_wrapper_is_torchs_own_without_settings(torch_forward_restored):
    route_offload_wrapper(lambda: None)  # sm_activation_offloading off, or no mp.init()
    model = offload_wrapper(build())
    assert_parity(train(model, batches(), optimizer=sgd, loss_fn=lm_loss), reference())
    assert offloader_of(model) is None
    route_offload_wrapper(None)
    assert OffloadWrapper.forward is TORCH_OFFLOAD_FORWARD


def test_offloading_without_checkpointing_says_so(caplog, torch_forward_restored):
    caplog.set_level(logging.WARNING, logger="modelparallel")
    assert offload_checkpointed(build(), "cpu", 4) is None
    route_offload_wrapper(lambda: (torch.device("cpu"), 2))
    model = offload_wrapper(build())
    assert_parity(train(model, batches(), optimizer=sgd, loss_fn=lm_loss), reference())
    assert [r.getMessage() for r in caplog.records] == [
        "offload_activations=True has no effect: no module this rank holds is checkpointed "
        "(SMP offloads only checkpointed activations; mark layers with "
        "smp.set_activation_checkpointing)",
        "sm_activation_offloading: no checkpointed layer under offload_wrapper, so nothing is "
        "prefetched: what its forward saves goes to CPU and comes back when backward needs it "
        "(apply activation checkpointing first)"]
    stats = offloader_of(model).stats  # type: ignore[union-attr]
    assert stats.layers_offloaded == 0 and stats.tensors_offloaded > 0


def test_horizon_defaults_are_smps_per_api():
    assert loading_horizon(None, v2=False) == 4 and loading_horizon(None, v2=True) == 2
    assert loading_horizon(3, v2=False) == loading_horizon(3, v2=True) == 3
    with pytest.raises(ValueError, match="must be >= 1"):
        ActivationOffloader("cpu", 0)


def test_torch_internals_we_rely_on():
    """parallel/offload_torch.py relies on these; this fails if torch changes them."""
    inner = torch.nn.Linear(2, 2)
    wrapper = offload_wrapper(inner)
    assert isinstance(wrapper, OffloadWrapper) and wrapped_module(wrapper) is inner
    assert callable(TORCH_OFFLOAD_FORWARD)
    # torch's checkpoint (both kinds) saves its inputs through the enclosing
    # saved-tensor hooks, and nothing else: what a checkpointed layer keeps
    for reentrant in (False, True):
        packed: list[torch.Tensor] = []
        x = torch.randn(3, 2, requires_grad=True).tanh()
        with torch.autograd.graph.saved_tensors_hooks(packed.append, lambda _, x=x: x):
            out = torch.utils.checkpoint.checkpoint(lambda a: inner(a).relu().sin(), x,
                                                    use_reentrant=reentrant)
        # (torch 2.11's non-reentrant checkpoint also saves an empty marker tensor)
        assert [p for p in packed if p.numel()] == [x], reentrant
        out.sum().backward()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_inputs_leave_the_gpu_and_gradients_match(torch_forward_restored):
    """After forward, a horizon-2 run holds 2 layers' inputs on the GPU where plain
    checkpointing holds all 8 (measured by the allocator); gradients are the same."""
    device = torch.device("cuda")
    cfg = GPTConfig(vocab_size=64, max_seq_len=256, d_model=256, n_layers=8, n_heads=4)
    x, y = (t.to(device) for t in token_batches(1, 16, 256, 64, seed=1)[0])
    layer_input = 16 * 256 * 256 * 4  # bytes of one block's input
    held, grads, losses = {}, {}, {}
    route_offload_wrapper(lambda: (device, 2))
    for how in ("plain", "v1", "v2"):
        model = loss = None
        gc.collect()  # the previous run's model (checkpointed modules hold cycles)
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        if how == "v2":
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
            model = offload_wrapper(model)
        else:
            mp.set_activation_checkpointing(model.blocks)
            apply_marks(model)
        if how == "v1":
            offload_checkpointed(model, device, 2)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        loss = lm_loss(model(x), y)
        torch.cuda.synchronize()
        torch.empty(1, device=device)  # lets the allocator reclaim what the copies used
        held[how] = torch.cuda.memory_allocated() - base
        loss.backward()
        losses[how] = loss.item()
        grads[how] = [p.grad.clone() for p in model.parameters()]
        if how != "plain":
            stats = offloader_of(model).stats  # type: ignore[union-attr]
            assert stats.layers_offloaded == 8 and stats.max_resident == 2, stats
    assert held["plain"] - held["v1"] >= 6 * layer_input, held
    assert held["v2"] < held["v1"], held  # v2 offloads the rest of the root's forward too
    for how in ("v1", "v2"):
        assert losses[how] == losses["plain"]
        for a, b in zip(grads[how], grads["plain"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
