"""Pipeline parallelism (SMP v1 style) vs one process: losses every step, parameters at the end."""


import pytest
import torch
from torch import nn

import modelparallel as mp
from modelparallel.models import GPT, GPTConfig
from modelparallel.models.gpt import lm_loss
from modelparallel.parallel.activation import is_recomputed
from modelparallel.testing import WorkerError, assert_parity, token_batches, train
from modelparallel.testing.parity import TrainResult

STEPS = 5
GLOBAL_BATCH = 8
SEQ, VOCAB = 16, 64


def gpt(layers: int = 4, tied: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, d_model=32, n_layers=layers,
                          n_heads=4))
    if tied:
        model.lm_head.weight = model.tok_emb.weight
    return model


def sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def reference(layers: int, tied: bool = False) -> TrainResult:
    return train(gpt(layers, tied), token_batches(STEPS, GLOBAL_BATCH, SEQ, VOCAB, seed=1),
                 optimizer=lambda m: sgd(m.parameters()), loss_fn=lm_loss)


@mp.step
def train_step(model, x, y):
    loss = lm_loss(model(x), y)
    model.backward(loss)
    return loss


@mp.step
def eval_step(model, x):
    return model(x)


def pipeline_case(config: dict, layers: int = 4, tied: bool = False, manual: bool = False,
                  checkpointed: bool = False):
    mp.init(config)
    ref = reference(layers, tied)
    model = gpt(layers, tied)
    if manual:  # SMP v1: place the last layer alone on the last stage
        for block in model.blocks[:-1]:
            mp.set_partition(block, 0)
        with mp.partition(config["pipeline_parallel_degree"] - 1):  # made here: placed there
            last = type(model.blocks[-1])(model.cfg)
        last.load_state_dict(model.blocks[-1].state_dict())
        model.blocks[-1] = last
    model = mp.DistributedModel(model)
    if checkpointed:  # SMP v1 scripts mark modules after wrapping
        mp.set_activation_checkpointing(model.module.blocks)
    optimizer = mp.DistributedOptimizer(sgd(model.parameters()))

    losses = []
    rows = GLOBAL_BATCH // mp.dp_size()
    for x, y in token_batches(STEPS, GLOBAL_BATCH, SEQ, VOCAB, seed=1):
        x, y = (t[mp.dp_rank() * rows:(mp.dp_rank() + 1) * rows] for t in (x, y))
        optimizer.zero_grad()
        loss = train_step(model, x, y).reduce_mean().detach().double()
        torch.distributed.all_reduce(loss, group=mp.get_dp_process_group())
        losses.append(float(loss) / mp.dp_size())
        optimizer.step()
    params = model.state_dict()
    if tied:
        params.setdefault("lm_head.weight", params["tok_emb.weight"])
    assert_parity(TrainResult(losses, params), ref)
    held = list(model.local_modules())
    blocks = [b for b in model.module.blocks if any(b is m for m in held)]
    recomputed = [m for m in held if is_recomputed(m)]
    if manual:  # set_partition put blocks 0..2 on stage 0, mp.partition the last on 1
        expected = model.module.blocks[:-1] if mp.pp_rank() == 0 else model.module.blocks[-1:]
        assert blocks == list(expected), (mp.pp_rank(), len(blocks))
    assert recomputed == (blocks if checkpointed else [])

    x = token_batches(1, GLOBAL_BATCH, SEQ, VOCAB, seed=2)[0][0]
    with torch.no_grad():
        logits = eval_step(model, x).concat()  # every rank gets the last stage's output
        trained = gpt(layers, tied)
        trained.load_state_dict(ref.params)
        torch.testing.assert_close(logits, trained(x), rtol=1e-5, atol=1e-6)
    return losses, model.display_partition()


PP2 = {"pipeline_parallel_degree": 2}
CASES = [
    # pp 2 and 4 x microbatches 1, 2, 4, 8 x GPipe and 1F1B (1F1B with fewer
    # microbatches than stages runs as GPipe)
    *[(pp, {"pipeline_parallel_degree": pp, "microbatches": m, "pipeline": schedule}, {})
      for pp in (2, 4) for m in (1, 2, 4, 8) for schedule in ("simple", "interleaved")],
    (2, {**PP2, "microbatches": 2}, {"tied": True}),
    (4, {"pipeline_parallel_degree": 4, "microbatches": 4}, {"tied": True}),  # middle stages
    (2, {**PP2, "microbatches": 2}, {"manual": True}),
    (4, {**PP2, "microbatches": 2, "hybrid_shard_degree": 1}, {}),  # pp 2 x DDP 2
    (2, {"pipeline_parallel_degree": 1, "microbatches": 2, "hybrid_shard_degree": 1}, {}),
    # two stages per rank: 4 stages of one layer on 2 ranks
    (2, {**PP2, "microbatches": 4, "pipeline": "interleaved_1f1b"}, {}),
    (2, {**PP2, "microbatches": 4, "pipeline": "interleaved_1f1b"}, {"tied": True}),
    (2, {**PP2, "microbatches": 2, "pipeline": "looped_bfs"}, {}),
    (2, {**PP2, "microbatches": 4, "pipeline": "interleaved_zero_bubble"}, {}),
    (2, {**PP2, "microbatches": 4, "pipeline": "zbv_zero_bubble"}, {"tied": True}),
    (2, {**PP2, "microbatches": 4, "pipeline": "dualpipe_v"}, {}),
    # active_microbatches: the schedule runs in rounds
    (2, {**PP2, "microbatches": 4, "pipeline": "simple", "active_microbatches": 2}, {}),
    (2, {**PP2, "microbatches": 4, "pipeline": "interleaved", "active_microbatches": 1}, {}),
    # tensor and sharded data parallelism inside DistributedModel
    (4, {**PP2, "microbatches": 2, "hybrid_shard_degree": 2}, {}),  # pp 2 x FSDP 2
    (4, {**PP2, "microbatches": 2, "hybrid_shard_degree": 2}, {"tied": True}),
    (4, {**PP2, "microbatches": 2, "tensor_parallel_degree": 2}, {}),
    (4, {**PP2, "microbatches": 2, "tensor_parallel_degree": 2}, {"tied": True}),
    (8, {**PP2, "microbatches": 2, "hybrid_shard_degree": 2}, {}),  # pp 2 x (2 x 2 HSDP)
    (8, {**PP2, "microbatches": 2, "tensor_parallel_degree": 2, "hybrid_shard_degree": 2}, {}),
    (8, {**PP2, "microbatches": 2, "tensor_parallel_degree": 2, "hybrid_shard_degree": 2},
     {"tied": True}),
    (2, {"pipeline_parallel_degree": 1, "microbatches": 2, "tensor_parallel_degree": 2}, {}),
    (4, {"pipeline_parallel_degree": 1, "microbatches": 2, "tensor_parallel_degree": 2,
         "hybrid_shard_degree": 2}, {}),
    # activation checkpointing (mp.set_activation_checkpointing)
    (2, {**PP2, "microbatches": 2}, {"checkpointed": True}),
    (4, {**PP2, "microbatches": 2, "hybrid_shard_degree": 2}, {"checkpointed": True}),
    (4, {"pipeline_parallel_degree": 1, "microbatches": 2, "tensor_parallel_degree": 2,
         "hybrid_shard_degree": 2}, {"checkpointed": True}),
]


ABBREVIATIONS = {"active_microbatches": "active", "tensor_parallel_degree": "tp",
                 "hybrid_shard_degree": "hsd"}


def case_id(case) -> str:
    world, config, opts = case
    return "-".join([f"w{world}", f"pp{config['pipeline_parallel_degree']}",
                     f"mb{config['microbatches']}", config.get("pipeline", "interleaved"),
                     *[f"{short}{config[k]}" for k, short in ABBREVIATIONS.items() if k in config],
                     *opts])


def _tier(case):
    """The parity matrix proves these layouts (schedules, microbatches, tied weights, tp,
    hsd, checkpointing, on every path); placement by mp.partition and active_microbatches
    it does not vary: those stay in the default tier, the rest run in the extended one."""
    _, config, opts = case
    own = "manual" in opts or "active_microbatches" in config
    return pytest.param(case, marks=[] if own else [pytest.mark.extended], id=case_id(case))


@pytest.mark.parametrize("case", [_tier(c) for c in CASES])
def test_pipeline_parity(workers, case):
    world, config, opts = case
    results = workers(world).run(pipeline_case, config=config, **opts)
    losses = [r[0] for r in results]
    assert all(x == losses[0] for x in losses)


def misuse_case():
    mp.init({"microbatches": 2})
    model = mp.DistributedModel(gpt(2))
    problems = []
    for call in (lambda: model(torch.zeros(2, SEQ, dtype=torch.long)),
                 lambda: model.backward(torch.zeros(()))):
        try:
            call()
        except mp.OutsideStepError as e:
            problems.append(str(e))
    try:
        mp.DistributedModel(gpt(2))
    except RuntimeError as e:
        problems.append(str(e))
    return problems


def test_model_outside_a_step_and_a_second_model_are_errors(workers):
    outside_call, outside_backward, second = workers(1).run(misuse_case)[0]
    assert outside_call.startswith("calling the DistributedModel must run inside a function "
                                   "decorated with @mp.step")
    assert outside_backward.startswith("model.backward() must run inside")
    assert "only one mp.DistributedModel may exist per process" in second


def methods_case(config: dict):
    mp.init(config)
    calls = []
    model = mp.DistributedModel(gpt(4))
    model.register_post_partition_hook(lambda m, o: calls.append((m.partitioned, o)))
    optimizer = mp.DistributedOptimizer(sgd(model.parameters()))

    def step(x, y):
        optimizer.zero_grad()
        loss = train_step(model, x, y).reduce_mean()
        optimizer.step()
        return float(loss)

    batches = token_batches(4, GLOBAL_BATCH, SEQ, VOCAB, seed=3)
    with torch.no_grad():  # an evaluation first: the split and FSDP's gathering happen here
        eval_step(model, batches[0][0])
    for x, y in batches[:2]:
        step(x, y)
    saved_model, saved_optimizer = model.state_dict(), optimizer.state_dict()
    first = [step(x, y) for x, y in batches[2:]]
    model.load_state_dict(saved_model)
    optimizer.load_state_dict(saved_optimizer)  # momentum buffers included
    again = [step(x, y) for x, y in batches[2:]]

    local = dict(model.local_named_parameters())
    modules = {name for name, m in model.module.named_modules()
               if any(m is lm for lm in model.local_modules())}
    return {"hook": [(partitioned, o is optimizer) for partitioned, o in calls],
            "first": first, "again": again, "local": sorted(local),
            "modules": modules, "state": len(optimizer.local_state_dict()["state"]),
            "params": len(list(model.local_parameters())),
            "full": sorted(saved_model)}


@pytest.mark.parametrize("config", [
    {**PP2, "microbatches": 2},
    {**PP2, "microbatches": 2, "hybrid_shard_degree": 2},
], ids=["pp2", "pp2-fsdp2"])
def test_model_and_optimizer_methods(workers, config):
    world = 2 * config.get("hybrid_shard_degree", 1)
    results = workers(world).run(methods_case, config=config)
    for r in results:
        assert r["hook"] == [(True, True)]  # once, after the split, with the optimizer
        assert r["again"] == r["first"]     # state dicts restore model and optimizer
        assert r["state"] == r["params"]    # momentum for exactly the held parameters
    by_stage = {mp_rank: results[rank] for rank, mp_rank in ((0, 0), (world - 1, 1))}
    stage0, stage1 = by_stage[0], by_stage[1]
    assert "tok_emb.weight" in stage0["local"] and "tok_emb.weight" not in stage1["local"]
    assert "lm_head.weight" in stage1["local"] and "blocks.0.ln_1.weight" in stage0["local"]
    assert "blocks.3" in stage1["modules"] and "blocks.3" not in stage0["modules"]
    names = {n for n, _ in gpt(4).named_parameters()}
    assert set(stage0["local"]) | set(stage1["local"]) == names
    assert not set(stage0["local"]) & set(stage1["local"])
    assert set(stage0["full"]) >= names


def no_backward_case():
    mp.init({**PP2, "microbatches": 2})
    model = mp.DistributedModel(gpt(4))
    x, y = token_batches(1, GLOBAL_BATCH, SEQ, VOCAB)[0]

    @mp.step
    def forgets_backward(model, x, y):
        return lm_loss(model(x), y)

    forgets_backward(model, x, y)


def test_a_training_step_without_backward_says_what_to_do(workers):
    with pytest.raises(WorkerError) as err:
        workers(2).run(no_backward_case)
    assert ("the step function returned without calling model.backward(loss) while "
            "gradients are enabled; call model.backward(loss), or run evaluation steps "
            "under torch.no_grad()") in str(err.value)
