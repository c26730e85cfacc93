"""The planner never promises less than a run uses, for a mixture of experts: a tiny
Hugging Face Mixtral trained for real on 2 gloo ranks (hybrid_shard 2, and expert
parallelism 2), its peak measured by torch's ``MemTracker`` (building, then every step)
and its collectives counted, against the plan. The run's router routes as it does: the
plan's peak (the worst routing) must be at or above it; its all-to-all bytes are a
balanced router's, printed beside the run's."""

from __future__ import annotations

import gc

import pytest

import modelparallel as mp

BATCH, SEQ = 2, 64
STEPS = 4
LAYOUTS = {
    "hsd2": {"hybrid_shard_degree": 2},
    "ep2": {"hybrid_shard_degree": 2, "expert_parallel_degree": 2},
}


def tiny_mixtral():
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=256, use_cache=False)
    return transformers.MixtralForCausalLM(config)


def workload(config: dict):
    from modelparallel.plan.workload import Workload

    return Workload(tiny_mixtral, config, 2, BATCH, SEQ, api="v2")


def measured(config: dict) -> tuple[list[int], dict[str, float]]:
    """One rank of the real run: MemTracker's peaks (building, each step) and the bytes
    its collectives sent in the last step, per group."""
    import torch

    from modelparallel.observe.collectives import CollectiveCounter
    from modelparallel.plan.fake_world import forget_sharding_caches
    from modelparallel.plan.workload import TrainingScript
    from modelparallel.testing.mem_tracker import run_peaks

    forget_sharding_caches()
    mp.init(config)
    torch.manual_seed(mp.state.rank)  # each rank its own tokens, so its own routing
    gc.collect()
    scripts = []

    def build():
        scripts.append(TrainingScript(workload(config), mp))
        return scripts[0]

    peaks = run_peaks(build, STEPS, mp.state.context.device)
    counter = CollectiveCounter(mp.state.group_labels)
    with counter:
        scripts[0].step()
    return peaks, dict(counter.bytes)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_planned_peak_covers_a_moe_run(workers, layout):
    from modelparallel.plan import plan_job

    config = LAYOUTS[layout]
    runs = workers(2).run(measured, config=config)
    planned = plan_job(workload(config))
    for rank, ((peaks, sent), plan) in enumerate(zip(runs, planned.ranks, strict=True)):
        peak = max(peaks)
        balanced = plan.peak_tensor_bytes_balanced_routing or plan.peak_tensor_bytes
        print(f"{layout} rank {rank}: planned {plan.peak_tensor_bytes} (routing "
              f"{plan.routing or 'none needed'}), balanced {balanced}, MemTracker {peaks}: "
              f"ratio {plan.peak_tensor_bytes / peak:.4f} worst, {balanced / peak:.4f} "
              f"balanced; collectives planned {plan.comm_bytes}, run {sent}")
        assert peak <= plan.peak_tensor_bytes, f"{layout} rank {rank}: {plan}, {peaks}"
        if layout == "hsd2":  # no routing assumed: the experts' shapes do not depend on it
            assert plan.routing == "" and plan.peak_tensor_bytes <= 1.05 * peak
            assert plan.comm_bytes == sent
        else:
            assert plan.routing == "worst" and balanced <= plan.peak_tensor_bytes
