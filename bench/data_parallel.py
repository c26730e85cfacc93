"""Benchmark: mp.shard vs fully_shard by hand, and collective bytes vs theory.

    python bench/data_parallel.py [--world-size 4] [--steps 20]

Runs in real gloo processes on this machine and prints, as its last line, ratios
measured in this one run:

- shard_step_time: median step time of ``mp.shard`` (hybrid 2 x 2) over the same
  model wrapped by hand with ``fully_shard`` on the same mesh shape; steps alternate
  between the two so machine noise hits both alike (goal <= 1.02);
- ddp_bytes, fsdp_bytes, hybrid_bytes: collective bytes each rank moved in a steady
  step over the textbook minimum, P = parameter bytes, N ranks, S shards, R replicas:
  DDP 2P(N-1)/N, FSDP 3P(N-1)/N, hybrid 3P(S-1)/S + 2(P/S)(R-1)/R (goal within 2%).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import modelparallel as mp
from modelparallel.models import GPT, GPTConfig
from modelparallel.models.gpt import lm_loss
from modelparallel.observe import CollectiveCounter
from modelparallel.testing import WorkerGroup

MODEL = {"vocab_size": 256, "max_seq_len": 64, "d_model": 256, "n_layers": 8, "n_heads": 8}
BATCH = 4  # sequences per rank


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(**MODEL))


def _step(model, opt, inputs, targets):
    opt.zero_grad(set_to_none=True)
    lm_loss(model(inputs), targets).backward()
    opt.step()


def _batch():
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(MODEL["vocab_size"], (BATCH, MODEL["max_seq_len"] + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def time_case(steps: int, replicas: int, shards: int) -> dict:
    """Step times of mp.shard and of the same plan applied by hand with fully_shard.

    Two rounds with fresh models, built in opposite order, each alternating the
    two variants step by step; the ratio is the median of adjacent-pair ratios,
    averaged (geometrically) over the rounds, so drift and build order cancel out.
    """
    mp.init({"hybrid_shard_degree": shards})
    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))

    def by_hand():
        model = _model()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    inputs, targets = _batch()
    ratios, medians = [], {"ours": [], "hand": []}
    for round_ in range(2):
        builders = [("ours", lambda: mp.shard(_model())), ("hand", by_hand)]
        order = builders if round_ == 0 else builders[::-1]
        models = {name: build() for name, build in order}
        opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
        times: dict[str, list[float]] = {"ours": [], "hand": []}
        for i in range(steps + 2):  # two warm-up steps each
            for name in ("ours", "hand") if i % 2 else ("hand", "ours"):
                dist.barrier()
                start = time.perf_counter()
                _step(models[name], opts[name], inputs, targets)
                dist.barrier()
                if i >= 2:
                    times[name].append(time.perf_counter() - start)
        ratios.append(statistics.median(a / b for a, b in zip(times["ours"], times["hand"],
                                                               strict=True)))
        for name in medians:
            medians[name].append(statistics.median(times[name]))
    return {"ratio": math.prod(ratios) ** (1 / len(ratios)),
            **{name: statistics.mean(v) for name, v in medians.items()}}


def bytes_case(config: dict, kind: str) -> dict:
    """Collective bytes of one steady-state step (the third), per group, on this rank."""
    mp.init(config)
    model = _model()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model = mp.replicate(model) if kind == "ddp" else mp.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, targets = _batch()
    for _ in range(2):  # DDP rebuilds its buckets in step 2
        _step(model, opt, inputs, targets)
    with CollectiveCounter(mp.state.group_labels) as counter:
        _step(model, opt, inputs, targets)
    return {"param_bytes": param_bytes, "bytes": dict(counter.bytes)}


def theory(kind: str, p: float, n: int, replicas: int, shards: int) -> float:
    if kind == "ddp":
        return 2 * p * (n - 1) / n
    if kind == "fsdp":
        return 3 * p * (n - 1) / n
    return 3 * p * (shards - 1) / shards + 2 * (p / shards) * (replicas - 1) / replicas


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
            p = got["param_bytes"]
            measured = sum(got["bytes"].values())
            expected = theory(kind, p, n, replicas, shards)
            ratios[f"{kind}_bytes"] = measured / expected
            groups = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sorted(got["bytes"].items()))
            print(f"{kind:6} P={p / 2**20:.2f} MiB: measured {measured / 2**20:.3f} MiB per rank "
                  f"per step ({groups}); theory {expected / 2**20:.3f} MiB")
    print("RATIOS " + " ".join(f"{k}={v:.4f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
