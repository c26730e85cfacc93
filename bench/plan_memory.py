"""Benchmark: the planner's peak memory per rank over torch's ``MemTracker`` in a real run.

    python bench/plan_memory.py [--d-model 128] [--layers 2] [--batch 4] [--seq 128]

For a GPT-like model in the layouts tp2, hsd2, pp2 and hsd2 x tp2, plans each rank's
peak with ``modelparallel.plan.plan_job`` (a simulation: no real process group, fake
tensors) and measures the same training script in real gloo processes under torch's
``MemTracker`` (live tensor bytes as torch counts them, building the model and then
every step; gloo's working copies are allocated on gloo's own threads and are not in
it, so the planner's peak of tensors alone, ``peak_tensor_bytes``, is what is compared).
Prints one line per layout and rank, and as its last line the ratios planned / measured
(the goal: at or above 1.00, at most 1.05).
"""

from __future__ import annotations

import argparse
import gc
from functools import partial

import torch

import modelparallel as mp
from modelparallel.models.gpt import GPT, GPTConfig
from modelparallel.testing import WorkerGroup

LAYOUTS = {
    "tp2": (2, {"tensor_parallel_degree": 2}),
    "hsd2": (2, {"hybrid_shard_degree": 2}),
    "pp2": (2, {"pipeline_parallel_degree": 2, "microbatches": 2}),
    "hsd2xtp2": (4, {"hybrid_shard_degree": 2, "tensor_parallel_degree": 2}),
}
STEPS = 4  # the first (which makes the optimizer state) and three more


def gpt_like(d_model: int, layers: int, seq: int) -> torch.nn.Module:
    return GPT(GPTConfig(vocab_size=256, d_model=d_model, n_layers=layers, n_heads=4,
                         max_seq_len=seq))


def workload(args: argparse.Namespace, config: dict, world: int):
    from modelparallel.plan.workload import Workload

    return Workload(partial(gpt_like, args.d_model, args.layers, args.seq), config, world,
                    args.batch, args.seq)


def measured(args: argparse.Namespace, config: dict, world: int) -> int:
    """This rank's MemTracker peak over building the model and every step."""
    from modelparallel.plan.fake_world import forget_sharding_caches
    from modelparallel.plan.workload import TrainingScript
    from modelparallel.testing.mem_tracker import run_peaks

    forget_sharding_caches()
    mp.init(config)
    gc.collect()
    peaks = run_peaks(lambda: TrainingScript(workload(args, config, world), mp), STEPS,
                      mp.state.context.device)
    return max(peaks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args()

    from modelparallel.plan import plan_job

    ratios = {}
    for name, (world, config) in LAYOUTS.items():
        with WorkerGroup(world) as group:
            peaks = group.run(measured, args=args, config=config, world=world)
        plan = plan_job(workload(args, config, world))
        worst = 0.0
        for rank, (peak, planned) in enumerate(zip(peaks, plan.ranks, strict=True)):
            ratio = planned.peak_tensor_bytes / peak
            print(f"{name} rank {rank}: planned {planned.peak_tensor_bytes} B, "
                  f"MemTracker {peak} B, ratio {ratio:.4f}", flush=True)
            worst = ratio if not worst else min(worst, ratio)
        ratios[name] = worst
    print("plan_over_memtracker (lowest rank): " +
          ", ".join(f"{k}={v:.4f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
