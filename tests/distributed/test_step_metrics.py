"""mp.observe: per-step metrics, and collective bytes equal to the textbook figures.

The model is a stack of Linear blocks with no parameters of its own in the root and
sizes divisible by every shard count, so FSDP pads nothing and the measured bytes
must equal the theory exactly: DDP 2P(N-1)/N, FSDP 3P(N-1)/N, hybrid 3P(S-1)/S
within a shard group plus 2(P/S)(R-1)/R across replicas (P = parameter bytes).
"""

import json

import pytest
import torch
from torch import nn

import modelparallel as mp


def blocks_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(4)))


def metrics_case(config, kind, jsonl):
    mp.init(config)
    model = blocks_model()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model = mp.replicate(model) if kind == "ddp" else mp.shard(model)
    printed = []
    metrics = mp.observe.StepMetrics(jsonl=jsonl, printer=printed.append)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        with metrics.step(samples=8 * mp.size(), tokens=64 * mp.size()) as rec:
            opt.zero_grad()
            loss = model(torch.full((8, 64), float(mp.rank() + step))).pow(2).mean()
            loss.backward()
            opt.step()
            rec.loss = loss
    return {"records": [r.__dict__ for r in metrics.records], "printed": printed,
            "param_bytes": param_bytes, "local_loss": loss.item()}


# FSDP's step also all-reduces, over the data-parallel ranks, two int32 flags per
# parameter (which ones some rank used: parallel/unused_grads.py): 2 x 3/4 x 32 bytes
FLAGS = 2 * 3 / 4 * 2 * 4 * 4 / (4 * 64 * 64 * 4)


@pytest.mark.parametrize(("config", "kind", "expected"), [
    ({"hybrid_shard_degree": 1}, "ddp", {"dp_replicate": 2 * 3 / 4}),
    ({}, "fsdp", {"dp_shard": 3 * 3 / 4 + FLAGS}),
    ({"hybrid_shard_degree": 2}, "fsdp", {"dp_shard": 3 * 1 / 2, "dp_replicate": 2 / 2 * 1 / 2,
                                          "dp": FLAGS}),
])
def test_collective_bytes_match_theory(workers, tmp_path, config, kind, expected):
    jsonl = tmp_path / "metrics.jsonl"
    results = workers(4).run(metrics_case, config=config, kind=kind, jsonl=str(jsonl))
    for got in results:
        psi = got["param_bytes"]
        for rec in got["records"]:
            measured = {k: v / psi for k, v in rec["comm_bytes"].items()}
            # DDP broadcasts its rebuilt bucket order once, in step 2 (a few bytes)
            assert measured == pytest.approx(expected, rel=1e-3), rec["comm_bytes"]
        # the steady state is exact; the loss average over data-parallel ranks happens
        # after the counted window
        last = {k: v / psi for k, v in got["records"][-1]["comm_bytes"].items()}
        assert last == pytest.approx(expected, rel=1e-12)
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3], "rank 0 alone writes one line per step"
    losses = [got["local_loss"] for got in results]
    assert lines[-1]["loss"] == pytest.approx(sum(losses) / len(losses))
    rec = lines[-1]
    assert rec["samples"] == 32 and rec["step_time_s"] > 0
    assert rec["samples_per_s"] == pytest.approx(32 / rec["step_time_s"])
    assert rec["tokens_per_s"] == pytest.approx(256 / rec["step_time_s"])
    assert rec["peak_memory_bytes"] > 0 and rec["memory_kind"] == "tensors"
    printed = results[0]["printed"]
    assert len(printed) == 3 and printed[0].startswith("step     1 | loss ")
    assert "samples/s" in printed[0] and "comm " in printed[0]
    assert results[1]["printed"] == [], "only rank 0 prints"


def tensor_memory_case():
    mp.init({})
    model = mp.shard(blocks_model())
    metrics = mp.observe.StepMetrics(memory_steps=2, printer=lambda line: None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        with metrics.step(samples=8 * mp.size()):
            opt.zero_grad()
            model(torch.full((8, 64), float(mp.rank() + step))).pow(2).mean().backward()
            opt.step()
    local = [p.to_local() for p in model.parameters()] + \
        [p.grad.to_local() for p in model.parameters()]
    return [r.__dict__ for r in metrics.records], sum(t.numel() * t.element_size() for t in local)


def test_cpu_peak_memory_is_the_measured_tensor_bytes(workers):
    for records, params_and_grads in workers(2).run(tensor_memory_case):
        first, second, third = records
        assert first["memory_kind"] == second["memory_kind"] == "tensors"
        assert first["peak_memory_bytes"] >= params_and_grads > 0
        assert second["peak_memory_bytes"] >= params_and_grads
        # the third step is not measured: it repeats the largest measured peak
        assert third["memory_kind"] == "tensors, max of steps 1-2"
        assert third["peak_memory_bytes"] == max(first["peak_memory_bytes"],
                                                 second["peak_memory_bytes"])


def functional_collective_case():
    mp.init({})
    model = mp.shard(blocks_model())
    weight = model[0].weight  # a DTensor sharded over the 4 ranks
    with mp.observe.CollectiveCounter(mp.state.group_labels) as counter:
        weight.full_tensor()  # DTensor gathers with a functional collective
    return dict(counter.bytes), dict(counter.calls), weight.numel() * weight.element_size()


def test_functional_collectives_are_counted(workers):
    for got_bytes, calls, full in workers(4).run(functional_collective_case):
        assert calls == {"dp_shard": 1}
        assert got_bytes == {"dp_shard": full * 3 / 4}


def uneven_all_to_all_case():
    import torch.distributed as dist

    import modelparallel as mp

    mp.init({})
    send = [3, 1] if dist.get_rank() == 0 else [2, 2]
    receive = [3, 2] if dist.get_rank() == 0 else [1, 2]
    rows = torch.ones(sum(send), 5)
    out = torch.empty(sum(receive), 5)
    with mp.observe.CollectiveCounter(mp.state.group_labels) as counter:
        dist.all_to_all_single(out, rows, output_split_sizes=receive, input_split_sizes=send)
    return sum(counter.bytes.values())


def test_an_uneven_all_to_all_counts_the_rows_that_leave_the_rank(workers):
    """Expert parallelism's dispatch: rank 0 keeps 3 rows and sends 1, rank 1 keeps 2
    and sends 2 (rows of 5 float32)."""
    assert workers(2).run(uneven_all_to_all_case) == [1 * 20.0, 2 * 20.0]


def shared_group_labels_case() -> dict[str, int]:
    """Expert parallelism on 2 ranks: the experts' group is the data-parallel shard
    group (one process group); its label names both, so FSDP's traffic is not shown as
    the experts'."""
    import torch.distributed as dist

    import modelparallel as mp

    mp.init({"expert_parallel_degree": 2})
    with mp.observe.CollectiveCounter(mp.state.group_labels) as counter:
        dist.all_reduce(torch.ones(4), group=mp.state.context.meshes["dp_shard"].get_group())
    return dict(counter.calls)


def test_a_group_both_layout_and_expert_parallel_is_labelled_with_both(workers):
    assert workers(2).run(shared_group_labels_case) == [{"dp_shard+ep_index": 1}] * 2
