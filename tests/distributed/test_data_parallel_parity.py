"""DDP, FSDP2 full and hybrid sharding, ZeRO-2 and the FSDP1 path vs one process."""

import functools

import pytest
import torch

import modelparallel as mp
from modelparallel.models import GPT, GPTConfig
from modelparallel.models.gpt import lm_loss
from modelparallel.testing import assert_parity, token_batches, train

STEPS = 5
GLOBAL_BATCH = 8
CFG = GPTConfig(vocab_size=64, max_seq_len=16, d_model=32, n_layers=2, n_heads=2)


def build_model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def batches():
    return token_batches(STEPS, GLOBAL_BATCH, CFG.max_seq_len, CFG.vocab_size, seed=1)


@functools.cache
def reference():
    return train(build_model(), batches(), optimizer=sgd, loss_fn=lm_loss)


def wrap_model(kind: str, model, **kwargs):
    if kind == "ddp":
        return mp.replicate(model)
    if kind == "smddp":
        from modelparallel.dataparallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if kind == "fsdp2":
        return mp.shard(model, **kwargs)
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        from modelparallel.models.gpt import Block

        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), **kwargs)
    raise ValueError(kind)


def parity_case(config: dict, kind: str, **kwargs):
    mp.init(config)
    model = wrap_model(kind, build_model(), **kwargs)
    replica = (mp.rdp_rank(), mp.rdp_size())
    return train(model, batches(), optimizer=sgd, loss_fn=lm_loss, replica=replica,
                 group=mp.get_rdp_process_group())


CASES = [
    # (world size, config, how the model is wrapped, extra arguments)
    (2, {"hybrid_shard_degree": 1}, "ddp", {}),
    (4, {"hybrid_shard_degree": 1}, "ddp", {}),
    (4, {}, "smddp", {}),
    (2, {}, "fsdp2", {}),
    (4, {}, "fsdp2", {}),
    (8, {}, "fsdp2", {}),
    (4, {"hybrid_shard_degree": 2}, "fsdp2", {}),  # 2 replicas x 2 shards
    (8, {"hybrid_shard_degree": 4}, "fsdp2", {}),  # 2 x 4
    (8, {"hybrid_shard_degree": 2}, "fsdp2", {}),  # 4 x 2
    (4, {"hybrid_shard_degree": 1}, "fsdp2", {}),  # replicate only, through FSDP2
    (4, {"hybrid_shard_degree": 2}, "fsdp2", {"reshard_after_forward": False}),  # ZeRO-2
    (4, {"hybrid_shard_degree": 2}, "fsdp1", {}),
    (8, {"hybrid_shard_degree": 4}, "fsdp1", {}),
]


@pytest.mark.parametrize(("world", "config", "kind", "kwargs"), CASES,
                         ids=[f"{w}ranks-{k}-{c}-{kw}" for w, c, k, kw in CASES])
def test_parity(workers, world, config, kind, kwargs):
    results = workers(world).run(parity_case, config=config, kind=kind, **kwargs)
    for rank, result in enumerate(results):
        assert len(result.losses) == STEPS, rank
        assert_parity(result, reference())

def test_reference_moves_far_beyond_the_tolerance():
    """Parity would prove little if training barely changed the parameters."""
    start = build_model().state_dict()
    moved = [(reference().params[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)
             for k, v in start.items() if "k_proj.bias" not in k]
    assert min(moved) > 1e-3
