"""The SMP v2 scripts' sharded optimizer checkpoint of a tensor-parallel FSDP1 model.

``mp.transform`` then an unchanged FSDP1 wrap; ``FSDP.optim_state_dict`` under
``SHARDED_STATE_DICT`` saved with DCP into a directory per tp rank, and loaded back with
torch's ``load_sharded_optimizer_state_dict`` (which takes no process group) and
``FSDP.optim_state_dict_to_load``, as SageMaker's shared-scripts do. Every optimizer
state tensor must come back as saved, and the resumed run must match an uninterrupted
one at every step.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import modelparallel as mp
from modelparallel.data import replica_rank_and_size
from modelparallel.models import GPT, GPTConfig
from modelparallel.models.gpt import Block, lm_loss
from modelparallel.smp.v2.checkpoint import state_dict_saver as saver
from modelparallel.smp.v2.checkpoint.filesystem import DistributedFileSystemReader
from modelparallel.testing import full_parameters, local_rows, token_batches

SEQ, VOCAB = 16, 64
CFG = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, d_model=32, n_layers=2, n_heads=4)


def build(seed: int, use_orig_params: bool) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(seed)
    return FSDP(mp.transform(GPT(CFG)), auto_wrap_policy=ModuleWrapPolicy({Block}),
                use_orig_params=use_orig_params)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch) -> float:
    inputs, targets = local_rows(batch, *replica_rank_and_size())
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    value = loss.detach().double()
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's optimizer state, every tensor (copies)."""
    return {f"{i}.{name}": value.detach().clone()
            for i, state in optimizer.state_dict()["state"].items()
            for name, value in state.items() if isinstance(value, torch.Tensor)}


def resume_case(root: str, use_orig_params: bool) -> dict:
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    mp.init({"tensor_parallel_degree": 2, "hybrid_shard_degree": 1})
    data = token_batches(4, 8, SEQ, VOCAB, seed=1)
    model = build(0, use_orig_params)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = [step(model, opt, b) for b in data[:2]]
    path = os.path.join(root, f"tp{mp.state.topology.coordinate(mp.rank())['tp']}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # FSDP.state_dict_type, ShardedTensor
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, opt)}
        saver.save(state, checkpoint_id=path, process_group=model.process_group,
                   coordinator_rank=min(dist.get_process_group_ranks(model.process_group)))
        saved = optimizer_state(opt)
        losses += [step(model, opt, b) for b in data[2:]]  # uninterrupted

        fresh = build(1, use_orig_params)  # other initial values
        opt2 = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
        with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
            target = {"model": fresh.state_dict()}
            dcp.load(target, process_group=fresh.process_group,
                     storage_reader=DistributedFileSystemReader(path))
            fresh.load_state_dict(target["model"])
            optim = load_sharded_optimizer_state_dict(
                model_state_dict=target["model"], optimizer_key="optimizer",
                storage_reader=DistributedFileSystemReader(path))
            opt2.load_state_dict(FSDP.optim_state_dict_to_load(fresh, opt2,
                                                              optim["optimizer"]))
    loaded = optimizer_state(opt2)
    differ = sorted(k for k in saved.keys() | loaded.keys()
                    if k not in saved or k not in loaded or not torch.equal(saved[k], loaded[k]))
    resumed = [step(fresh, opt2, b) for b in data[2:]]
    return {"state": len(saved), "differ": differ, "losses": losses[2:], "resumed": resumed,
            "same_params": all(torch.equal(a, b) for a, b in zip(
                full_parameters(model).values(), full_parameters(fresh).values(), strict=True))}


@pytest.mark.parametrize("use_orig_params", [True, False], ids=["orig-params", "flat-params"])
def test_sharded_optimizer_state_of_tensor_parallel_fsdp1_round_trips(workers, tmp_path,
                                                                      use_orig_params):
    """tp 2 on 2 ranks (one data-parallel rank): each rank reads its tp rank's checkpoint."""
    for got in workers(2).run(resume_case, root=str(tmp_path),
                              use_orig_params=use_orig_params):
        assert got["state"] > 0
        assert got["differ"] == [], "optimizer state tensors differ from the saved ones"
        assert got["resumed"] == got["losses"]
        assert got["same_params"]
    assert sorted(os.listdir(tmp_path)) == ["tp0", "tp1"]
