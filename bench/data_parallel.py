"""Benchmark: mp.shard vs fully_shard by hand, and collective bytes vs theory.

    python bench/data_parallel.py [--world-size 4] [--steps 20]

Runs in real gloo processes on this machine and prints, as its last line, ratios
measured in this one run:

- shard_step_time: median step time of ``mp.shard`` (hybrid 2 x 2) over the same
  model wrapped by hand with ``fully_shard`` on the same mesh shape; steps alternate
  between the two so machine noise hits both alike (goal <= 1.02);
- ddp_bytes, fsdp_bytes, hybrid_bytes: the ring-model bytes of the collectives each rank
  ran in a steady step (``CollectiveCounter`` sees every collective with its real tensor
  and group, and counts what a bandwidth-optimal ring would send for it: a model, not
  a measurement of the wire) over the textbook minimum, P = parameter bytes, B = bytes
  of the blocks (FSDP units that reshard after forward; the root stays gathered for
  backward, as FSDP does by default), N ranks, S shards, R replicas: DDP 2P(N-1)/N,
  FSDP (2P + B)(N-1)/N, hybrid (2P + B)(S-1)/S + 2(P/S)(R-1)/R (goal within 2%).
"""

from __future__ import annotations

import argparse

import torch
from paired_timing import compare_step_times, lm_batch, lm_step
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import modelparallel as mp
from modelparallel.models import GPT, GPTConfig
from modelparallel.observe import CollectiveCounter
from modelparallel.testing import WorkerGroup

MODEL = {"vocab_size": 256, "max_seq_len": 64, "d_model": 256, "n_layers": 8, "n_heads": 8}
BATCH = 4  # sequences per rank


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(**MODEL))






def _batch():
    return lm_batch(MODEL["vocab_size"], MODEL["max_seq_len"], BATCH)


def time_case(steps: int, replicas: int, shards: int) -> dict:
    """Step times of mp.shard and of the same plan applied by hand with fully_shard.

    Measured by ``paired_timing.compare_step_times`` (alternating steps, two rounds).
    """
    mp.init({"hybrid_shard_degree": shards})
    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))

    def by_hand():
        model = _model()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    return compare_step_times(lambda: mp.shard(_model()), by_hand,
                              lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                              _batch(), steps)


def bytes_case(config: dict, kind: str) -> dict:
    """Collective bytes of one steady-state step (the third), per group, on this rank."""
    mp.init(config)
    model = _model()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    block_bytes = sum(p.numel() * p.element_size() for b in mp.find_blocks(model)
                      for p in b.parameters())
    model = mp.replicate(model) if kind == "ddp" else mp.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, targets = _batch()
    for _ in range(2):  # DDP rebuilds its buckets in step 2
        lm_step(model, opt, inputs, targets)
    with CollectiveCounter(mp.state.group_labels) as counter:
        lm_step(model, opt, inputs, targets)
    return {"param_bytes": param_bytes, "block_bytes": block_bytes, "bytes": dict(counter.bytes)}


def theory(kind: str, p: float, b: float, n: int, replicas: int, shards: int) -> float:
    """Ring bytes per rank per step: all-gather P in forward and the resharded blocks B
    again in backward, reduce-scatter P; replicas all-reduce their shard P/S."""
    if kind == "ddp":
        return 2 * p * (n - 1) / n
    if kind == "fsdp":
        return (2 * p + b) * (n - 1) / n
    return (2 * p + b) * (shards - 1) / shards + 2 * (p / shards) * (replicas - 1) / replicas


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    args = ap.parse_args()
    n = args.world_size
    replicas, shards = 2, n // 2
    with WorkerGroup(n, case_timeout_s=1800) as group:
        t = group.run(time_case, steps=args.steps, replicas=replicas, shards=shards)[0]
        print(f"step time ({2 * args.steps} steps each, {n} ranks, hybrid {replicas}x{shards}): "
              f"mp.shard {t['ours'] * 1e3:.1f} ms, fully_shard by hand {t['hand'] * 1e3:.1f} ms "
              f"(median)")
        ratios = {"shard_step_time": t["ratio"]}
        for kind, config in (("ddp", {"hybrid_shard_degree": 1}), ("fsdp", {}),
                             ("hybrid", {"hybrid_shard_degree": shards})):
            got = group.run(bytes_case, config=config, kind=kind if kind == "ddp" else "fsdp")[0]
            p, b = got["param_bytes"], got["block_bytes"]
            counted = sum(got["bytes"].values())
            expected = theory(kind, p, b, n, replicas, shards)
            ratios[f"{kind}_bytes"] = counted / expected
            groups = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sorted(got["bytes"].items()))
            print(f"{kind:6} P={p / 2**20:.2f} MiB (blocks {b / 2**20:.2f}): ring-model bytes of "
                  f"the collectives run {counted / 2**20:.3f} MiB per rank per step ({groups}); "
                  f"theory {expected / 2**20:.3f} MiB")
    print("RATIOS " + " ".join(f"{k}={v:.4f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
