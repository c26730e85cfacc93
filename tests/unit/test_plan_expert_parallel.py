"""The planner with mixtures of experts: the routing it assumes for expert parallelism,
the search recommending an expert-parallel layout exactly when the experts do not fit
otherwise, and one line for what it cannot simulate."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from modelparallel.parallel.expert_parallel.ownership import local_experts
from modelparallel.plan import PlanError, Workload, plan_job
from modelparallel.plan import search as searching
from modelparallel.plan.device_model import PROFILES
from modelparallel.plan.experts import routed_counts
from modelparallel.plan.search import layouts, search
from modelparallel.plan.table import ranking


def mixtral(intermediate: int = 1024, experts: int = 8, **kwargs) -> nn.Module:
    """Experts much larger than the rest: 8 x 3 x 1024 x 64 float32 per layer."""
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
        num_experts_per_tok=2, max_position_embeddings=64, use_cache=False, **kwargs)
    return transformers.MixtralForCausalLM(config)


@pytest.mark.parametrize("ep", [2, 4])
def test_routings_send_every_choice_and_bound_what_a_rank_receives(ep):
    tokens, top_k, total = 10, 3, 8
    index = torch.empty(tokens, top_k, dtype=torch.long)
    for rank in range(ep):
        experts = local_experts(total, rank, ep)
        send, receive = routed_counts("balanced", experts, ep, index, index, index)
        assert sum(send) == tokens * top_k and max(send) - min(send) <= 1
        worst_send, worst = routed_counts("worst", experts, ep, index, index, index)
        assert sum(worst_send) == tokens * top_k
        # a token's choices are distinct experts: at most as many here as held here
        assert worst == [tokens * min(top_k, total // ep)] * ep
        assert worst_send[rank] == worst[rank] and sum(worst) >= sum(receive)


def test_search_recommends_ep_when_the_experts_do_not_fit_otherwise():
    device = PROFILES["h100"]
    work = Workload(mixtral, {}, world_size=2, batch_size=1, seq_len=16)
    found = search(work, device, memory_per_device=40 * 2**20)
    with_ep = [c for c in found if c.config["expert_parallel_degree"] == 2]
    without = [c for c in found if c.config["expert_parallel_degree"] == 1 and c.plan]
    assert len(with_ep) == 2 and all(c.refused is None for c in with_ep)
    assert all(c.config["tensor_parallel_degree"] == 1 == c.config["pipeline_parallel_degree"]
               for c in with_ep)
    assert all(c.plan is not None and c.plan.work.api == "v2" for c in with_ep)
    assert without and all("> 40.00 MiB per device" in (c.refused or "") for c in without)
    assert found[0] in with_ep
    assert "expert parallelism is SMP v2's" in ranking(found, device)
    for rank in found[0].plan.ranks:
        assert rank.routing == "worst"
        assert 0 < rank.peak_bytes_balanced_routing <= rank.peak_bytes


def test_the_search_ranks_expert_parallel_layouts_with_tensor_parallelism(monkeypatch):
    # every ep degree dividing the data-parallel size and the experts, with and without
    # tensor parallelism, never with a pipeline
    with_ep = [(c["pipeline_parallel_degree"], c["tensor_parallel_degree"],
                c["hybrid_shard_degree"], c["expert_parallel_degree"])
               for c in layouts(4, {}, experts=(8, 8)) if c["expert_parallel_degree"] > 1]
    assert sorted(with_ep) == [(1, 1, 1, 2), (1, 1, 1, 4), (1, 1, 2, 2), (1, 1, 2, 4),
                               (1, 1, 4, 2), (1, 1, 4, 4), (1, 2, 1, 2), (1, 2, 2, 2)]
    # (pp 1, tp 2, hybrid_shard 1): without ep it does not fit; with ep 2 it is simulated
    # (transform + shard) and recommended
    every = layouts
    monkeypatch.setattr(searching, "layouts", lambda *args, **kwargs: [
        c for c in every(*args, **kwargs)
        if (c["pipeline_parallel_degree"], c["tensor_parallel_degree"],
            c["hybrid_shard_degree"]) == (1, 2, 1)])
    device = PROFILES["h100"]
    found = search(Workload(mixtral, {}, world_size=4, batch_size=1, seq_len=16), device,
                   memory_per_device=40 * 2**20)
    assert [c.config["expert_parallel_degree"] for c in found] == [2, 1]
    assert found[0].refused is None and found[0].plan is not None
    assert found[0].plan.work.api == "v2"
    assert "> 40.00 MiB per device" in (found[1].refused or "")
    assert ranking(found, device).splitlines()[1].startswith("pp 1, tp 2, hybrid_shard 1, ep 2")


def test_an_eager_experts_loop_is_one_line():
    work = Workload(lambda: mixtral(64, 4, experts_implementation="eager"),
                    {"hybrid_shard_degree": 2}, world_size=2, batch_size=1, seq_len=8)
    with pytest.raises(PlanError, match=r"experts_implementation='eager'.*'grouped_mm'"):
        plan_job(work, [0])


class RoutedByMask(nn.Module):
    """A mixture of experts the library does not know: experts in a list, tokens picked
    by a boolean mask (a shape that depends on the router's values)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.router = nn.Linear(16, 2)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).reshape(-1, 16)
        choice = self.router(h).argmax(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            picked = choice == e
            out[picked] = expert(h[picked])
        return self.head(out).reshape(*x.shape, 32)


def test_a_routing_the_planner_does_not_know_is_one_line():
    work = Workload(RoutedByMask, {}, world_size=1, batch_size=1, seq_len=8)
    with pytest.raises(PlanError, match=r"shape depends on values \(aten\.nonzero.*"
                                        r"test_plan_expert_parallel.py:\d+: .*h\[picked\]"):
        plan_job(work)
