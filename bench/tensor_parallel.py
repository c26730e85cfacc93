"""Benchmark: tensor-parallel bytes vs Megatron, and mp.transform + mp.shard vs by hand.

    python bench/tensor_parallel.py [--world-size 4] [--steps 30] [--layers 2]

Runs in real gloo processes on this machine and prints, as its last line, ratios
measured in this one run:

- tp_bytes: tensor-parallel ring-model bytes (``CollectiveCounter``: what a ring would
  send for each collective run, computed from its real tensors — a model, not a
  measurement of the wire) per layer of one forward + backward, over Megatron's
  8·b·s·h·(t-1)/t elements (4 all-reduces of b·s·h per layer: 2 forward after the
  row-parallel layers, 2 backward for the column-parallel layers' input gradients,
  each costing 2(t-1)/t on a ring). Measured as (bytes(2L layers) - bytes(L)) / L,
  so the embedding and LM-head traffic cancels (goal 0.95 - 1.05);
- tp_step_time: median step time of ``mp.transform`` + ``mp.shard`` (tp 2 x
  dp_shard 2) over the same plan applied by hand with ``parallelize_module`` and
  ``fully_shard`` on the same meshes; steps alternate between the two so machine
  noise hits both alike (goal <= 1.02).
"""

from __future__ import annotations

import argparse
import warnings
from collections import Counter

import torch
from paired_timing import compare_step_times, lm_batch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

import modelparallel as mp
from modelparallel.models import GPT, GPTConfig
from modelparallel.models.gpt import lm_loss
from modelparallel.observe import CollectiveCounter
from modelparallel.testing import WorkerGroup

MODEL = {"vocab_size": 256, "max_seq_len": 64, "d_model": 256, "n_layers": 4, "n_heads": 8}
BATCH = 4  # sequences per rank
TP = 2


def _model(**overrides):
    torch.manual_seed(0)
    return GPT(GPTConfig(**(MODEL | overrides)))






_NOT_COMMS = {"wait_tensor", "_wrap_tensor_autograd"}  # bookkeeping ops, no traffic


class OpCounter(CollectiveCounter):
    """A CollectiveCounter that also tallies calls per (op, shape of its first tensor)."""

    def __init__(self, labels=None):
        super().__init__(labels)
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional") and func._opname not in _NOT_COMMS:
            first = args[0][0] if isinstance(args[0], (list, tuple)) and args[0] else args[0]
            shape = tuple(first.shape) if isinstance(first, torch.Tensor) else ()
            self.ops[f"{func._opname}{list(shape)}"] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


# every rank of the TP group passes the same batch, as in the by-hand and Megatron figures
TP_SAME_BATCH = {"tensor_parallel_degree": TP, "prescaled_batch": True}


def bytes_case(layers: int) -> dict:
    """TP bytes and ops of one forward and one backward, for ``layers`` and ``2*layers``."""
    mp.init(TP_SAME_BATCH)
    inputs, targets = _batch()
    out = {}
    for n_layers in (layers, 2 * layers):
        model = mp.transform(_model(n_layers=n_layers))
        lm_loss(model(inputs), targets).backward()  # warm-up
        model.zero_grad(set_to_none=True)
        with OpCounter(mp.state.group_labels) as fwd:
            loss = lm_loss(model(inputs), targets)
        with OpCounter(mp.state.group_labels) as bwd:
            loss.backward()
        out[n_layers] = {phase: {"bytes": dict(c.bytes), "ops": dict(c.ops)}
                         for phase, c in (("forward", fwd), ("backward", bwd))}
    return out


def _block_plan():
    shared = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
    return {"attn": shared, "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
            "mlp.fc_in": ColwiseParallel(), "mlp.fc_out": RowwiseParallel()}


def _root_plan():
    return {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}


def _batch():
    return lm_batch(MODEL["vocab_size"], MODEL["max_seq_len"], BATCH)


def time_case(steps: int, shards: int) -> dict:
    """Step times of mp.transform + mp.shard and of the same plan applied by hand.

    Measured by ``paired_timing.compare_step_times`` (alternating steps, two rounds).
    """
    # Both variants' root returns the LM head's gathered logits, a view; FSDP2 warns of it.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
    mp.init({**TP_SAME_BATCH, "hybrid_shard_degree": shards})
    tp_mesh, dp_mesh = mp.state.meshes["tp"], mp.state.context.data_parallel_mesh()

    def ours():
        return mp.shard(mp.transform(_model()))

    def by_hand():
        model = _model()
        for block in model.blocks:
            parallelize_module(block, tp_mesh, _block_plan())
        parallelize_module(model, tp_mesh, _root_plan())
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh)
        return fully_shard(model, mesh=dp_mesh)

    return compare_step_times(ours, by_hand, lambda m: torch.optim.SGD(m.parameters(), lr=1e-2),
                              _batch(), steps)


def megatron_bytes_per_layer(t: int, element_size: int = 4) -> float:
    b, s, h = BATCH, MODEL["max_seq_len"], MODEL["d_model"]
    return 8 * b * s * h * (t - 1) / t * element_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per variant and round")
    ap.add_argument("--layers", type=int, default=2, help="L for the bytes difference")
    args = ap.parse_args()
    n, L = args.world_size, args.layers
    shards = n // TP
    ratios = {}
    with WorkerGroup(n, case_timeout_s=1800) as group:
        got = group.run(bytes_case, layers=L)[0]
        per_layer = {}
        for phase in ("forward", "backward"):
            one, two = got[L][phase], got[2 * L][phase]
            per_layer[phase] = (two["bytes"].get("tp", 0.0) - one["bytes"].get("tp", 0.0)) / L
            other = sorted(set(one["bytes"]) - {"tp"})
            ops = {k: (two["ops"].get(k, 0) - one["ops"].get(k, 0)) / L
                   for k in sorted(set(one["ops"]) | set(two["ops"]))}
            ops_text = ", ".join(f"{k} x{v:g}" for k, v in ops.items() if v)
            print(f"tp {phase:8}: {per_layer[phase] / 2**20:.3f} MiB per layer; collectives per "
                  f"layer: {ops_text or 'none'} (Megatron: 2 all-reduces of b·s·h)"
                  + (f"; other groups: {other}" if other else ""))
            totals = ", ".join(f"{k} x{v}" for k, v in sorted(two["ops"].items()))
            print(f"   all ops, {2 * L} layers, {phase}: {totals}")
        counted = sum(per_layer.values())
        expected = megatron_bytes_per_layer(TP)
        ratios["tp_bytes"] = counted / expected
        print(f"tp bytes (tp={TP}, b={BATCH}, s={MODEL['max_seq_len']}, h={MODEL['d_model']}, "
              f"fp32): ring-model bytes {counted / 2**20:.3f} MiB per layer per microbatch "
              f"(fwd+bwd), "
              f"Megatron 8bsh(t-1)/t = {expected / 2**20:.3f} MiB, ratio "
              f"{ratios['tp_bytes']:.4f}")

        t = group.run(time_case, steps=args.steps, shards=shards)[0]
        print(f"step time ({2 * args.steps} steps each, {n} ranks, tp {TP} x dp_shard {shards}, "
              f"{MODEL['n_layers']} layers, SGD): mp.transform+mp.shard {t['ours'] * 1e3:.1f} ms, "
              f"parallelize_module+fully_shard by hand {t['hand'] * 1e3:.1f} ms (median); "
              f"pair-ratio medians per round {', '.join(f'{r:.4f}' for r in t['rounds'])}")
        ratios["tp_step_time"] = t["ratio"]
    print("RATIOS " + " ".join(f"{k}={v:.4f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
