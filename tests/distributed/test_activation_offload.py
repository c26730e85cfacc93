"""Activation offloading trains like one process without it, on 1 and 2 ranks.

SMP v1: ``offload_activations`` with ``DistributedModel`` and layers marked with
``set_activation_checkpointing`` (one process, FSDP2 over 2 ranks, a 2-stage pipeline).
SMP v2: an FSDP script's torch ``apply_activation_checkpointing`` + torch
``offload_wrapper`` on the root, with ``sm_activation_offloading`` on (SMP's default:
our prefetching offloader) or off (torch's own). Losses every step and every parameter
at the end vs one process without offloading or checkpointing; the offloader's own
counts say it ran, within the horizon.
"""

import functools
import logging

import pytest
import torch

import modelparallel as mp
from modelparallel.models import GPT, GPTConfig
from modelparallel.models.gpt import Block, lm_loss
from modelparallel.parallel.offload_roots import offloader_of
from modelparallel.testing import TrainResult, assert_parity, full_parameters, token_batches, train

STEPS, GLOBAL_BATCH, LAYERS = 4, 8, 4
CFG = GPTConfig(vocab_size=64, max_seq_len=16, d_model=32, n_layers=LAYERS, n_heads=2)


def build() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def batches():
    return token_batches(STEPS, GLOBAL_BATCH, CFG.max_seq_len, CFG.vocab_size, seed=1)


@functools.cache
def reference() -> TrainResult:  # one process, no checkpointing, no offloading
    return train(build(), batches(), optimizer=lambda m: sgd(m.parameters()), loss_fn=lm_loss)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        if "offload" in record.getMessage():
            self.lines.append(record.getMessage())


def _capture() -> _Lines:
    handler = _Lines()
    logging.getLogger("modelparallel").addHandler(handler)
    return handler


def _stats(offloader):
    return None if offloader is None else dict(vars(offloader.stats),
                                                horizon=offloader.horizon)


@mp.step
def train_step(model, x, y):
    loss = lm_loss(model(x), y)
    model.backward(loss)
    return loss


def v1_case(config: dict, checkpointed: bool = True):
    """An SMP v1 script: DistributedModel, marked blocks, DistributedOptimizer."""
    lines = _capture()
    try:
        mp.init({"offload_activations": True, **config})
        model = mp.DistributedModel(build())
        if checkpointed:  # SMP v1 scripts mark modules after wrapping
            mp.set_activation_checkpointing(model.module.blocks)
        optimizer = mp.DistributedOptimizer(sgd(model.parameters()))
        losses = []
        rows = GLOBAL_BATCH // mp.dp_size()
        for x, y in batches():
            x, y = (t[mp.dp_rank() * rows:(mp.dp_rank() + 1) * rows] for t in (x, y))
            optimizer.zero_grad()
            loss = train_step(model, x, y).reduce_mean().detach().double()
            torch.distributed.all_reduce(loss, group=mp.get_dp_process_group())
            losses.append(float(loss) / mp.dp_size())
            optimizer.step()
        assert_parity(TrainResult(losses, model.state_dict()), reference())
        return _stats(offloader_of(model.module)), lines.lines
    finally:
        logging.getLogger("modelparallel").removeHandler(lines)


def v2_case(config: dict, wrap: str = "fsdp2"):
    """An SMP v2 script: FSDP, then torch's activation checkpointing of the blocks, then
    torch's offload_wrapper on the root."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
        offload_wrapper,
    )

    import modelparallel.smp.v2.activation_offload  # noqa: F401  (the switch; modelparallel imports it)

    mp.init(config)
    if wrap == "fsdp2":
        model = mp.shard(build())
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(build(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    impl = CheckpointImpl.REENTRANT if wrap == "fsdp1" else CheckpointImpl.NO_REENTRANT
    apply_activation_checkpointing(
        model, check_fn=lambda m: isinstance(m, Block),
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl))
    model = offload_wrapper(model)
    result = train(model, batches(), optimizer=lambda m: sgd(m.parameters()), loss_fn=lm_loss,
                   replica=(mp.rdp_rank(), mp.rdp_size()), group=mp.get_rdp_process_group())
    assert_parity(TrainResult(result.losses, full_parameters(model)), reference())
    return _stats(offloader_of(model)), [], mp.state.sm_activation_offloading


V1_CASES = [
    # (world size, config): one process (SMP v1's horizon 4), microbatches, FSDP2 on 2
    # ranks, a 2-stage pipeline with 2 microbatches in flight
    (1, {}),
    (1, {"microbatches": 2, "activation_loading_horizon": 1}),
    (2, {"activation_loading_horizon": 2}),
    (2, {"pipeline_parallel_degree": 2, "microbatches": 2, "activation_loading_horizon": 1}),
]


@pytest.mark.parametrize(("world", "config"), V1_CASES, ids=[f"{w}ranks-{c}" for w, c in V1_CASES])
def test_smp_v1_offload_activations_parity(workers, world, config):
    horizon = config.get("activation_loading_horizon", 4)  # SMP v1's default
    microbatches = config.get("microbatches", 1)
    layers_held = LAYERS // config.get("pipeline_parallel_degree", 1)
    for stats, lines in workers(world).run(v1_case, config=config):
        assert stats["horizon"] == horizon and not lines
        expected = STEPS * microbatches * layers_held
        if "pipeline_parallel_degree" in config:  # + torch's shape-inference forward
            assert expected <= stats["layers_offloaded"] <= expected + layers_held
        else:
            assert stats["layers_offloaded"] == expected
        assert 1 <= stats["max_resident"] <= horizon
        assert stats["prefetched"] + stats["fetched_on_demand"] >= expected


def test_smp_v1_nothing_checkpointed_says_so(workers):
    (stats, lines), = workers(1).run(v1_case, config={}, checkpointed=False)
    assert stats is None
    assert lines == ["offload_activations=True has no effect: no module this rank holds is "
                     "checkpointed (SMP offloads only checkpointed activations; mark layers "
                     "with smp.set_activation_checkpointing)"]


V2_CASES = [
    (1, {}, "fsdp2"),  # sm_activation_offloading defaults to True, the horizon to 2
    (2, {"activation_loading_horizon": 1}, "fsdp2"),
    (2, {"hybrid_shard_degree": 2}, "fsdp1"),  # torch FSDP1, reentrant checkpointing
    (2, {"sm_activation_offloading": False}, "fsdp2"),  # torch's own offload_wrapper
]


@pytest.mark.parametrize(("world", "config", "wrap"), V2_CASES,
                         ids=[f"{w}ranks-{k}-{c}" for w, c, k in V2_CASES])
def test_smp_v2_offload_wrapper_parity(workers, world, config, wrap):
    on = config.get("sm_activation_offloading", True)
    for stats, _, state_flag in workers(world).run(v2_case, config=config, wrap=wrap):
        assert state_flag is on
        if not on:
            assert stats is None  # torch's save_on_cpu ran, not ours
            continue
        horizon = config.get("activation_loading_horizon", 2)  # SMP v2's default
        assert stats["horizon"] == horizon
        assert stats["layers_offloaded"] == STEPS * LAYERS
        assert stats["tensors_offloaded"] > stats["layers_offloaded"]  # the rest of the root
        assert 1 <= stats["max_resident"] <= horizon
