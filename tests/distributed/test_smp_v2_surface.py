"""SMP v2's ``tsm.state`` attributes, ``transform(load_state_dict_from_rank0=...)`` and
the refusal of expert parallelism and of bad transform arguments, and the notice of a
``cp_comm_type`` without context parallelism, in 4 real processes (context parallelism
itself: test_context_parallel.py)."""

import functools
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import modelparallel as tsm
from modelparallel.config import ConfigError
from modelparallel.models import GPT, GPTConfig
from modelparallel.smp.v2.moe import MoEConfig
from modelparallel.testing import assert_parity, token_batches, train
from modelparallel.topology import CommGroup

CFG = GPTConfig(vocab_size=64, max_seq_len=16, d_model=32, n_layers=2, n_heads=4)
BATCHES = token_batches(3, 8, 16, 64, seed=3)


def lm_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


@functools.cache
def reference():
    torch.manual_seed(0)
    return train(GPT(CFG), BATCHES, optimizer=sgd, loss_fn=lm_loss)


def state_case():
    tsm.state.tensor_parallel_degree = 1  # before init: applied to the configuration
    initialized_before = tsm.is_initialized()
    tsm.init({"tensor_parallel_degree": 2, "hybrid_shard_degree": 1})
    s = tsm.state
    out = {  # each attribute written out: the compatibility table cites them here
        "initialized": (initialized_before, tsm.is_initialized()),
        "world_size": s.world_size, "rank": s.rank, "local_rank": s.local_rank,
        "hybrid_shard_degree": s.hybrid_shard_degree,
        "tensor_parallel_degree": s.tensor_parallel_degree, "tp_size": s.tp_size,
        "tp_rank": s.tp_rank, "context_parallel_degree": s.context_parallel_degree,
        "cp_size": s.cp_size, "cp_rank": s.cp_rank,
        "expert_parallel_degree": s.expert_parallel_degree, "ep_size": s.ep_size,
        "ep_rank": s.ep_rank, "dp_rank": s.dp_rank, "dp_size": s.dp_size,
        "sm_activation_offloading": s.sm_activation_offloading,
        "activation_loading_horizon": s.activation_loading_horizon}
    groups = {"world_process_group": s.world_process_group,
              "tp_process_group": s.tp_process_group, "dp_process_group": s.dp_process_group,
              "rep_rank_process_group": s.rep_rank_process_group,
              "cp_process_group": s.cp_process_group, "ep_process_group": s.ep_process_group}
    out["groups"] = {name: dist.get_process_group_ranks(pg) for name, pg in groups.items()}
    out["rep_groups"] = s.ranker.get_rep_groups()
    out["rep_rank"] = s.ranker.get_rep_rank(s.rank)
    out["cfg_fp16"] = s.cfg.fp16
    with pytest.raises(RuntimeError, match=r"cannot change after tsm\.init"):
        s.tensor_parallel_degree = 4
    tracker = s.get_rng_state_tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's stream is untouched
    tracker.set_states(states := tracker.get_states())
    with tracker.fork():
        second = torch.rand(3)
    assert not torch.equal(first, second)  # the tracked stream moved on
    tracker.set_states(states)
    out["rng"] = first.tolist()
    return out


def test_state_attributes_follow_the_layout(workers):
    results = workers(4).run(state_case)
    # the script set tensor_parallel_degree=1 on tsm.state before init: 4 replicas
    config = tsm.Config.load({"tensor_parallel_degree": 1, "hybrid_shard_degree": 1},
                             environ={})
    topo = tsm.Topology.from_config(config, 4)
    for rank, got in enumerate(results):
        assert got["initialized"] == (False, True)
        assert got["world_size"] == 4 and got["rank"] == rank and got["local_rank"] == rank
        assert got["tensor_parallel_degree"] == got["tp_size"] == 1 and got["tp_rank"] == 0
        assert got["hybrid_shard_degree"] == 1
        assert (got["context_parallel_degree"], got["cp_size"], got["cp_rank"]) == (1, 1, 0)
        assert (got["expert_parallel_degree"], got["ep_size"], got["ep_rank"]) == (1, 1, 0)
        assert got["dp_rank"] == rank and got["dp_size"] == 4
        assert got["sm_activation_offloading"] is True  # SMP v2's default
        assert got["activation_loading_horizon"] == 2
        assert got["groups"]["world_process_group"] == [0, 1, 2, 3]
        assert got["groups"]["tp_process_group"] == [rank]
        assert got["groups"]["dp_process_group"] == topo.group_ranks(rank, CommGroup.RDP_GROUP)
        assert got["groups"]["rep_rank_process_group"] == [rank]  # shard degree 1
        assert got["groups"]["cp_process_group"] == got["groups"]["ep_process_group"] == [rank]
        assert got["rep_groups"] == [[0, 1, 2, 3]] and got["rep_rank"] == rank
        assert got["cfg_fp16"] is False
    # model-parallel-rng: random_seed + tp rank, the same for every rank (tp rank 0)
    assert all(r["rng"] == results[0]["rng"] for r in results)


def tp_state_case():
    tsm.init({"tensor_parallel_degree": 2, "hybrid_shard_degree": 2})
    s = tsm.state
    return {"tp": (s.tp_rank, dist.get_process_group_ranks(s.tp_process_group)),
            "shard": dist.get_process_group_ranks(s.rep_rank_process_group),
            "rep_groups": s.ranker.get_rep_groups(), "hsd": s.hybrid_shard_degree,
            "rng": s.get_rng_state_tracker().get_states()["model-parallel-rng"][0]}


def test_tensor_parallel_state_and_ranker(workers):
    results = workers(4).run(tp_state_case)
    for rank, got in enumerate(results):
        assert got["tp"] == (rank % 2, [rank - rank % 2, rank - rank % 2 + 1])
        assert got["shard"] == [rank % 2, rank % 2 + 2] and got["hsd"] == 2
        assert got["rep_groups"] == [[0], [1], [2], [3]]  # one replica: nothing replicated
    # each rank of a tensor-parallel group draws its own masks in the tracked stream
    assert not torch.equal(results[0]["rng"], results[1]["rng"])
    assert torch.equal(results[0]["rng"], results[2]["rng"])


def rank0_weights_case():
    tsm.init({"tensor_parallel_degree": 2})
    torch.manual_seed(0)
    if dist.get_rank() == 0:
        model = GPT(CFG)  # the only rank with the weights (e.g. from_pretrained)
    else:
        torch.manual_seed(100 + dist.get_rank())
        with torch.device("meta"):
            model = GPT(CFG)
    model = tsm.transform(model, load_state_dict_from_rank0=True)
    tsm.shard(model)
    result = train(model, BATCHES, optimizer=sgd, loss_fn=lm_loss,
                   replica=(tsm.dp_rank(), tsm.dp_size()), group=tsm.get_dp_process_group())
    assert_parity(result, reference())
    return result.losses


def test_load_state_dict_from_rank0_trains_rank0s_model(workers):
    results = workers(4).run(rank0_weights_case)
    assert all(r == results[0] for r in results)


def refusals_case():
    tsm.init({"tensor_parallel_degree": 2})
    got = {}
    for config, error in ((MoEConfig(), ConfigError), ({"some_option": 1}, NotImplementedError)):
        with pytest.raises(error) as e:
            tsm.transform(GPT(CFG), config=config)
        got[type(config).__name__] = str(e.value)
    with pytest.raises(ValueError, match="cp_comm_type='ring'; SMP accepts 'p2p' or"):
        tsm.transform(GPT(CFG), cp_comm_type="ring")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("modelparallel").addHandler(handler)
    try:
        tsm.transform(GPT(CFG), cp_comm_type="all_gather")  # context_parallel_degree is 1
    finally:
        logging.getLogger("modelparallel").removeHandler(handler)
    got["cp_comm_type notices"] = seen
    if dist.get_rank() == 0:
        with pytest.raises(ConfigError, match="rank 0's model is on the meta device"), \
                torch.device("meta"):
            tsm.transform(GPT(CFG), load_state_dict_from_rank0=True)
    else:
        with pytest.raises(ConfigError):
            tsm.transform(GPT(CFG), load_state_dict_from_rank0=True)
    return got


def test_smp_moe_and_bad_arguments_are_refused(workers):
    results = workers(4).run(refusals_case)
    for got in results:
        assert "smp_moe: True, but GPT has no sparse MoE block SMP's MoE layer replaces" \
            in got["MoEConfig"]  # SMP's own MoE layer needs a mixture-of-experts model
        assert "SMP's transformer configuration options are not supported" in got["dict"]
    notices = [got["cp_comm_type notices"] for got in results]
    assert notices[0] == ["transform(cp_comm_type='all_gather') has no effect: "
                          "context_parallel_degree is 1"]
    assert notices[1:] == [[]] * 3  # one line per run, from rank 0


SEEN_TRACING: list[bool] = []


class Recorder(torch.nn.Module):
    """A layer that notes whether SMP's tracing step is running."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        SEEN_TRACING.append(tsm.is_tracing())
        return torch.relu(self.linear(x))


def v1_calls_case():
    tsm.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2,
              "ddp": True})
    SEEN_TRACING.clear()
    got = {"microbatches": tsm.num_microbatches()}
    got["gather"] = tsm.gather(tsm.rank(), tsm.PP_GROUP, rank=1)
    tsm.pp_barrier()
    tsm.tp_barrier()
    tsm.rdp_barrier()
    torch.manual_seed(0)
    model = tsm.DistributedModel(torch.nn.Sequential(*[Recorder() for _ in range(4)]))

    @tsm.step
    def forward(model, x):
        out = model(x)
        model.backward(out.sum())
        return out

    hooked = []
    model.register_post_step_hook(lambda m, opt: hooked.append(m is model))
    forward(model, torch.ones(4, 8))
    forward(model, torch.ones(4, 8))
    got["hooked"] = hooked  # once, after the first step
    got["tracing"] = sorted(set(SEEN_TRACING))
    got["after"] = tsm.is_tracing()
    got["local_modules"] = [n for n, _ in model.local_named_modules()]
    got["local_buffers"] = [n for n, _ in model.local_named_buffers()]
    got["same_buffers"] = [b is c for b, (_, c) in
                           zip(model.local_buffers(), model.local_named_buffers(), strict=True)]
    got["distributed"] = list(model.distributed_modules())  # no TP plan: nothing split
    with pytest.raises(NotImplementedError, match="uneven inputs"), model.join():
        pass
    with pytest.raises(NotImplementedError, match=r"register_comm_hook\(\) is not supported"):
        model.register_comm_hook(None, lambda *a: None)
    return got


def test_smp_v1_group_calls_and_tracing_flag(workers):
    results = workers(4).run(v1_calls_case)
    topo = tsm.Topology.from_config(tsm.Config.load(
        {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2}, environ={}), 4)
    for rank, got in enumerate(results):
        assert got["microbatches"] == 2
        pp_group = topo.group_ranks(rank, CommGroup.PP_GROUP)
        assert got["gather"] == (pp_group if rank == pp_group[1] else None)
        # rank 0 runs the tracing step (its timings decide the split for every rank),
        # then every rank runs its layers' real microbatches
        assert got["tracing"] == ([False, True] if rank == 0 else [False])
        assert got["after"] is False
        assert got["hooked"] == [True]
        stage = topo.coordinate(rank)["pp"]  # 4 equal layers: 2 per stage
        layers = [str(2 * stage), str(2 * stage + 1)]
        assert [n for n in got["local_modules"] if n.count(".") == 0 and n] == layers
        assert got["local_buffers"] == [f"{n}.calls" for n in layers]
        assert got["same_buffers"] == [True, True]
        assert got["distributed"] == []
