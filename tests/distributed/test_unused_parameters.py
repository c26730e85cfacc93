"""Parameters some or all data-parallel replicas did not use train as in one process.

Each block of the model runs a ``sometimes`` layer only when its replica's batch says so
(per step: replica 0 only, no replica, both) and never runs its ``never`` layer. One
process trains on the replicas' batches one after another (AdamW, lr 0.1, weight decay
0.1): a parameter no batch used gets no gradient, so AdamW leaves it alone and keeps no
state for it; one some batches used gets their gradients over the global batch. Every
case compares the loss of every step, every parameter at the end, and the optimizer
state of every parameter (present or absent, and its values) with that process, on
each path: ``DistributedModel`` with replicas that all-reduce (ddp, hybrid_shard_degree
1, tensor-parallel ranks holding a model without a plan), with a pipeline, and with
FSDP; ``mp.replicate`` (DDP with ``find_unused_parameters=True``; without it torch
refuses on every rank; of a tensor-parallel model, FSDP2's replicas, SGD with weight
decay); ``mp.shard`` (FSDP2); FSDP1 through the library's hook
(a parameter some ranks used trains as in one process; one no rank used is refused
in one line on every rank: FSDP1 steps a zero gradient for it).
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

import modelparallel as mp
from modelparallel.models import GPT, GPTConfig
from modelparallel.models.gpt import lm_loss
from modelparallel.testing import TrainResult, full_parameters, parity_problems, token_batches

W, ROWS, STEPS = 8, 8, 3
# per step, whether each replica's batch runs `sometimes`: replica 0 only, none, both
SIGNS = ((1, -1), (-1, -1), (1, 1))
SOME = ((1, -1), (-1, 1), (1, 1))  # always some replica


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.sometimes = nn.Linear(W, W)
        self.never = nn.Linear(W, W)

    def forward(self, h, switch: bool):
        out = torch.tanh(self.lin(h))
        if switch:
            out = out + self.sometimes(out)
        return out


class Switched(nn.Module):
    """Its forward reads the switch from the first input (every pipeline stage sees the
    first stage's inputs), so the blocks need no data-dependent branch of their own."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(W, 1)

    def forward(self, x):
        switch = bool(x[0, 0] > 0)
        for block in self.blocks:
            x = block(x, switch)
        return self.head(x)


def build(frozen: bool = False) -> Switched:
    """``frozen``: without `never` (FSDP1's flat parameters cannot freeze a part)."""
    torch.manual_seed(0)
    model = Switched()
    for block in model.blocks if frozen else []:
        del block.never
    return model


def batch(step: int, replica: int, signs=SIGNS) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``replica`` of 2's rows of step ``step``'s global batch."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(ROWS, W, generator=g), torch.randn(ROWS, 1, generator=g)
    rows = slice(replica * ROWS // 2, (replica + 1) * ROWS // 2)
    x = x[rows].clone()
    x[:, 0] = float(signs[step][replica])
    return x, y[rows]


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.1, weight_decay=0.1)


@functools.cache
def reference(signs=SIGNS, frozen: bool = False) -> tuple[TrainResult, dict]:
    model = build(frozen)
    opt = adamw(model.parameters())
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for replica in range(2):
            x, y = batch(step, replica, signs)
            loss = F.mse_loss(model(x), y) / 2
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    states = {n: _cpu(opt.state[p]) for n, p in model.named_parameters() if opt.state.get(p)}
    return TrainResult(losses, full_parameters(model)), states


def _cpu(state: dict) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
            for k, v in sorted(state.items())}


def _mean(loss: torch.Tensor, group: dist.ProcessGroup) -> float:
    value = loss.detach().double().clone()
    dist.all_reduce(value, group=group)
    return float(value) / dist.get_world_size(group)


# -- the cases (each returns losses, full parameters, optimizer state by name) --------

def v1_case(config: dict):
    mp.init(config)
    model = mp.DistributedModel(build())
    opt = mp.DistributedOptimizer(adamw(model.parameters()))

    @mp.step
    def train_step(model, x, y):
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        out = train_step(model, *batch(step, mp.dp_rank()))
        opt.step()
        losses.append(_mean(out.reduce_mean(), mp.get_dp_process_group()))
    held = dict(model.local_named_parameters())
    states = {n: _cpu(opt.optimizer.state[held[n]]) for n in sorted(held)
              if opt.optimizer.state.get(held[n])}
    return losses, model.state_dict(), states


def _train_v2(model: nn.Module, opt: torch.optim.Optimizer, signs=SIGNS):
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, mp.rdp_rank(), signs)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(_mean(loss, mp.get_rdp_process_group()))
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    states = {n: _cpu(s) for n, s in osd["state"].items() if s}
    return losses, full_parameters(model), states


def replicate_case(find_unused_parameters: bool):
    mp.init({"hybrid_shard_degree": 1})
    model = mp.replicate(build(), find_unused_parameters=find_unused_parameters)
    return _train_v2(model, adamw(model.parameters()))


def shard_case(config: dict):
    mp.init(config)
    model = mp.shard(build(), blocks=[Block])
    return _train_v2(model, adamw(model.parameters()))


def fsdp1_case(config: dict, use_orig_params: bool, signs=SIGNS, frozen: bool = False,
               checkpointed: bool = False):
    """``checkpointed``: each block's Linear layers checkpointed inside its FSDP unit
    (torch's wrapper, non-reentrant): backward runs their forward again on the
    parameters FSDP1 gathers anew for it."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    mp.init(config)
    model = FSDP(build(frozen), auto_wrap_policy=ModuleWrapPolicy({Block}),
                 use_orig_params=use_orig_params)
    if checkpointed:
        inside = {id(m) for m in model.modules() if isinstance(m, Block)
                  for m in m.modules() if isinstance(m, nn.Linear)}
        apply_activation_checkpointing(model, check_fn=lambda m: id(m) in inside)
    try:
        return _train_v2(model, adamw(model.parameters()), signs)
    except RuntimeError as e:
        return str(e)


def _problems(ranks: list, signs=SIGNS, frozen: bool = False) -> list[str]:
    reference_result, ref_states = reference(signs, frozen)
    problems = []
    states: dict[str, dict] = {}
    for losses, params, rank_states in ranks:
        problems += parity_problems(TrainResult(losses, params), reference_result)
        states.update(rank_states)  # pipeline ranks: each its stage's
    if sorted(states) != sorted(ref_states):
        problems.append(f"optimizer state for {sorted(states)}, one process has it for "
                        f"{sorted(ref_states)}")
    for name in sorted(set(states) & set(ref_states)):
        for key, want in ref_states[name].items():
            got = states[name].get(key)
            if got is None or got.shape != want.shape or \
                    not (got.float() - want.float()).abs().max() <= \
                    1e-5 * want.float().abs().max() + 1e-8:
                problems.append(f"optimizer state {name}.{key} differs")
    return problems


def test_the_reference_leaves_unused_parameters_alone():
    """What the cases compare against: no state for `never`, and `sometimes` moved less
    than if AdamW had decayed it through the step nobody used it (the defect: 1e-2)."""
    result, states = reference()
    assert not [n for n in states if ".never." in n]
    assert [n for n in states if ".sometimes." in n]
    start = build().state_dict()
    for name, value in result.params.items():
        if ".never." in name:
            assert torch.equal(value, start[name]), name


V1 = [
    (2, {"ddp": True}),
    (2, {"hybrid_shard_degree": 1}),
    (2, {"tensor_parallel_degree": 2}),  # no plan: the tp ranks are replicas
    (2, {}),  # FSDP2 over both ranks
    (4, {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True}),
    (4, {"pipeline_parallel_degree": 2, "microbatches": 2}),  # pp 2 x FSDP2 2
]


@pytest.mark.parametrize("world, config", V1, ids=["ddp", "hsd1", "tp2-unsplit", "fsdp2",
                                                   "pp2-ddp", "pp2-fsdp2"])
def test_distributed_model(workers, world, config):
    assert _problems(workers(world).run(v1_case, config=config)) == []


def test_replicate_with_find_unused_parameters(workers):
    assert _problems(workers(2).run(replicate_case, find_unused_parameters=True)) == []


def test_replicate_without_find_unused_parameters_is_torchs_error_on_every_rank(workers):
    """DDP's default waits for every parameter's gradient: torch refuses the second
    forward on every rank (none used `never`), naming find_unused_parameters."""
    with pytest.raises(Exception) as caught:
        workers(2).run(replicate_case, find_unused_parameters=False)
    text = str(caught.value)
    assert "--- rank 0 ---" in text and "--- rank 1 ---" in text
    assert text.count("find_unused_parameters=True") >= 2


@pytest.mark.parametrize("config", [{}, {"hybrid_shard_degree": 1}], ids=["full", "hsd1"])
def test_shard(workers, config):
    assert _problems(workers(2).run(shard_case, config=config)) == []


FSDP1 = [({}, True), ({"hybrid_shard_degree": 1}, True), ({}, False)]
FSDP1_IDS = ["full-shard", "no-shard", "flat-params"]


@pytest.mark.parametrize("checkpointed", [False, True], ids=["", "checkpointed"])
@pytest.mark.parametrize("config, use_orig_params", FSDP1, ids=FSDP1_IDS)
def test_fsdp1_with_a_parameter_only_some_ranks_used(workers, config, use_orig_params,
                                                     checkpointed):
    """Every step some replica runs `sometimes` (and there is no `never`): FSDP1's zeros
    on the others average to one process's gradient, and nothing is refused (also with
    activation checkpointing inside the units)."""
    ranks = workers(2).run(fsdp1_case, config=config, use_orig_params=use_orig_params,
                           signs=SOME, frozen=True, checkpointed=checkpointed)
    if not use_orig_params:  # flat optimizer state: compare losses and parameters only
        reference_result, _ = reference(SOME, True)
        for losses, params, _ in ranks:
            assert parity_problems(TrainResult(losses, params), reference_result) == []
        return
    assert _problems(ranks, SOME, True) == []


@pytest.mark.parametrize("config, use_orig_params", FSDP1, ids=FSDP1_IDS)
def test_fsdp1_refuses_a_parameter_no_rank_used(workers, config, use_orig_params):
    """FSDP1 would step a zero gradient for `never` (and its optimizer state dicts need
    a state for every parameter of a unit): the first step refuses, alike on every
    rank, in one line naming the parameters and the ways out."""
    messages = workers(2).run(fsdp1_case, config=config, use_orig_params=use_orig_params)
    assert messages[0] == messages[1]
    assert isinstance(messages[0], str) and "\n" not in messages[0]
    assert "blocks.0.never.weight" in messages[0] and "mp.shard()" in messages[0]


# -- mp.replicate of a tensor-parallel model: FSDP2's replicas ------------------------

class SwitchedGPT(nn.Module):
    """GPT (split by its plan) and a head only some replicas run, and one none runs."""

    def __init__(self):
        super().__init__()
        cfg = GPTConfig(vocab_size=64, max_seq_len=8, d_model=32, n_layers=2, n_heads=4)
        self.gpt = GPT(cfg)
        self.sometimes = nn.Linear(64, 64)
        self.never = nn.Linear(64, 64)

    def forward(self, x, switch: bool):
        out = self.gpt(x)
        return out + self.sometimes(out) if switch else out


def _gpt_steps(model, opt, replica: int | None) -> list[float]:
    """SGD steps over the replicas' halves (``replica`` None: one process, both)."""
    losses = []
    for step, (x, y) in enumerate(token_batches(STEPS, 4, 8, 64, seed=1)):
        opt.zero_grad()
        total = 0.0
        for r in range(2) if replica is None else [replica]:
            rows = slice(2 * r, 2 * r + 2)
            loss = lm_loss(model(x[rows], SIGNS[step][r] > 0), y[rows])
            (loss / 2 if replica is None else loss).backward()
            total += loss.item() / 2
        opt.step()
        losses.append(total if replica is None else 2 * total)
    return losses


def _sgd(model) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)


def replicate_tp_case():
    mp.init({"tensor_parallel_degree": 2, "hybrid_shard_degree": 1, "prescaled_batch": True})
    torch.manual_seed(0)
    model = mp.replicate(mp.transform(SwitchedGPT()))
    losses = _gpt_steps(model, _sgd(model), mp.rdp_rank())
    group = mp.get_rdp_process_group()
    return TrainResult([_mean(torch.tensor(v), group) for v in losses],
                       full_parameters(model))


def test_replicate_of_a_tensor_parallel_model(workers):
    """tp 2 x 2 replicas (FSDP2's DTensor replicas, SGD with weight decay): without zero
    filling the replicas' all-reduces differed and gloo aborted."""
    torch.manual_seed(0)
    model = SwitchedGPT()
    want = TrainResult(_gpt_steps(model, _sgd(model), None), full_parameters(model))
    for result in workers(4).run(replicate_tp_case):
        assert parity_problems(result, want) == []
