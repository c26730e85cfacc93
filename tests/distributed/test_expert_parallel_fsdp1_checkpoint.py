"""Sharded and full checkpoints of torch's FSDP1 with expert parallelism, as SMP v2's
scripts save them (``SHARDED_STATE_DICT``, ``FSDP.optim_state_dict``, DCP,
``load_sharded_optimizer_state_dict``, ``FSDP.optim_state_dict_to_load``), against one
process: the tiny float64 Mixtral and batches of ``test_expert_parallel``, wrapped as in
``test_expert_parallel_wrappers``.
"""

from __future__ import annotations

import torch
from test_expert_parallel import ROWS, batches, build, optimizer, reference
from test_expert_parallel_wrappers import plain_name, wrap
from torch import nn


def resume_case(root: str, saved_at: dict, resumed_at: dict, orig: bool) -> list[str]:
    """One step under FSDP1 at ``saved_at``, saved as SMP v2's scripts save
    (``SHARDED_STATE_DICT``, ``FSDP.optim_state_dict``, DCP); resumed at ``resumed_at`` into
    a model whose values were wiped, two more steps; what differs from one process's
    three steps."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    import modelparallel as tsm
    from modelparallel.data import replica_rank_and_size
    from modelparallel.smp.v2.moe import MoEConfig
    from modelparallel.testing import TrainResult, parity_problems

    def phase(config: dict) -> tuple[nn.Module, torch.optim.Optimizer]:
        tsm.reset()
        tsm.init(config)
        model = tsm.transform(build(), config=MoEConfig(smp_moe=False,
                                                        moe_load_balancing="none"))
        model = wrap(model, "fsdp1", "HYBRID_SHARD", orig)
        return model, optimizer(model)

    def step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
        index, count = replica_rank_and_size()
        rows = ROWS // count
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids[index * rows:(index + 1) * rows],
                     labels=ids[index * rows:(index + 1) * rows]).loss
        loss.backward()
        opt.step()
        value = loss.detach().double()
        dist.all_reduce(value)
        return float(value) / dist.get_world_size()

    data = batches()
    model, opt = phase(saved_at)
    losses = [step(model, opt, data[0])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # FSDP.state_dict_type, ShardedTensor
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            dcp.save({"model": model.state_dict(),
                      "optimizer": FSDP.optim_state_dict(model, opt)}, checkpoint_id=root)
        model, opt = phase(resumed_at)
        step(model, opt, data[0])  # the optimizer's state exists; the load overwrites it
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            target = {"model": model.state_dict()}
            dcp.load(target, checkpoint_id=root)
            model.load_state_dict(target["model"])
            optim = load_sharded_optimizer_state_dict(
                model_state_dict=target["model"], optimizer_key="optimizer",
                storage_reader=dcp.FileSystemReader(root))
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, optim["optimizer"]))
    losses += [step(model, opt, ids) for ids in data[1:]]
    ref_losses, ref_params, ref_states, _, _ = reference()
    full = StateDictOptions(full_state_dict=True)
    params = {plain_name(k): v for k, v in get_model_state_dict(model, options=full).items()}
    problems = parity_problems(TrainResult(losses, params),
                               TrainResult(ref_losses, ref_params))
    saved = get_optimizer_state_dict(model, opt, options=full)["state"]
    states = {f"{plain_name(name)}.{k}": v for name, s in saved.items() for k, v in s.items()}
    return problems + parity_problems(TrainResult([], states), TrainResult([], ref_states))


def test_fsdp1_sharded_checkpoint_with_expert_parallelism_resumes(workers, tmp_path):
    # the experts' optimizer states come back as ShardedTensors whose chunks are summed
    # over their ._process_group (torch's private attribute: this fails if it goes)
    # saved at ep 2 with each expert replicated over its 2 holders (FSDP1's hybrid
    # shard), resumed there and at ep 4 (each expert on one rank)
    hybrid = {"expert_parallel_degree": 2, "hybrid_shard_degree": 2}
    ep4 = {"expert_parallel_degree": 4, "hybrid_shard_degree": 2}
    for i, (resumed_at, orig) in enumerate([(hybrid, False), (ep4, True)]):
        for rank, problems in enumerate(workers(4).run(
                resume_case, root=str(tmp_path / str(i)), saved_at=hybrid,
                resumed_at=resumed_at, orig=orig)):
            assert problems == [], (resumed_at, rank, problems)


def full_round_trip_case(config: dict, orig: bool) -> list[str]:
    """One step under FSDP1, its ``FULL_STATE_DICT`` (model and ``FSDP.optim_state_dict``:
    every expert whole, plain tensors) loaded back into the model after its values were
    halved, two more steps; what differs from one process's three steps."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    import modelparallel as tsm
    from modelparallel.data import replica_rank_and_size
    from modelparallel.smp.v2.moe import MoEConfig
    from modelparallel.testing import TrainResult, full_parameters, parity_problems

    tsm.reset()
    tsm.init(config)
    model = tsm.transform(build(), config=MoEConfig(smp_moe=False, moe_load_balancing="none"))
    model = wrap(model, "fsdp1", "FULL_SHARD", orig)
    opt = optimizer(model)
    index, count = replica_rank_and_size()
    rows = slice(index * ROWS // count, (index + 1) * ROWS // count)
    losses = []
    for step, ids in enumerate(batches()):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids[rows], labels=ids[rows]).loss
        loss.backward()
        opt.step()
        value = loss.detach().double()
        dist.all_reduce(value)
        losses.append(float(value) / dist.get_world_size())
        if step:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # FSDP.state_dict_type
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                      FullStateDictConfig(rank0_only=False),
                                      FullOptimStateDictConfig(rank0_only=False)):
                saved = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
                states = [(f"{k}.{s}", t) for k, st in saved["optim"]["state"].items()
                          for s, t in st.items()]
                whole = [n for n, v in [*saved["model"].items(), *states] if ".experts." in n
                         and (type(v) is not torch.Tensor or v.shape[0] != 4)]
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.5)
                model.load_state_dict(saved["model"])
                opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, saved["optim"]))
    ref_losses, ref_params, _, _, _ = reference()
    problems = [f"{n} is not a whole plain tensor" for n in whole]
    return problems + parity_problems(TrainResult(losses, full_parameters(model)),
                                      TrainResult(ref_losses, ref_params))


def test_fsdp1_full_state_dicts_with_expert_parallelism_round_trip(workers):
    for orig in (True, False):
        for rank, problems in enumerate(workers(2).run(
                full_round_trip_case, config={"expert_parallel_degree": 2}, orig=orig)):
            assert problems == [], (orig, rank, problems)

