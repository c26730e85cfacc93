"""Train a small Mixtral on Python source with its experts split over ranks.

    modelparallel run --nproc-per-node 2 examples/expert_parallel/train_mixtral.py
    modelparallel run --nproc-per-node 4 examples/expert_parallel/train_mixtral.py \\
        --hybrid-shard-degree 2

With ``expert_parallel_degree`` 2 each rank holds half of every layer's experts and reads
its own rows (``mp.data``); each token travels to the ranks holding the experts its
router chose and back (all-to-all), and the router's load-balancing loss is computed
over the whole batch, so the training is one process's on all the ranks' rows
(docs/expert-parallel.md). ``--batch-size`` is per data-parallel rank: one process with
``--batch-size 4 --expert-parallel-degree 1`` trains what 2 ranks with ``--batch-size 2``
train.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from transformers import MixtralConfig, MixtralForCausalLM

import modelparallel as mp
from modelparallel.data.datasets import ByteChunks, python_source_bytes
from modelparallel.smp.v2.moe import MoEConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=2, help="rows per data-parallel rank")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--expert-parallel-degree", type=int, default=2)
    p.add_argument("--hybrid-shard-degree", type=int, default=0)
    p.add_argument("--aux-loss-coeff", type=float, default=0.01,
                   help="weight of the routers' load-balancing loss (moe_aux_loss_coeff)")
    p.add_argument("--log-every", type=int, default=5)
    args = p.parse_args()

    mp.init({"expert_parallel_degree": args.expert_parallel_degree,
             "hybrid_shard_degree": args.hybrid_shard_degree})
    torch.manual_seed(0)  # the same initial weights on every rank
    config = MixtralConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=args.experts, num_experts_per_tok=2,
                           max_position_embeddings=args.seq_len, use_cache=False)
    moe = MoEConfig(smp_moe=False, moe_load_balancing="aux_loss",
                    moe_aux_loss_coeff=args.aux_loss_coeff, moe_z_loss_coeff=0.0)
    model = mp.transform(MixtralForCausalLM(config), config=moe)
    mp.shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    loader = mp.data.DataLoader(ByteChunks(python_source_bytes(2_000_000), args.seq_len),
                                batch_size=args.batch_size, drop_last=True)
    losses: list[float] = []
    for inputs, _ in loader:
        optimizer.zero_grad(set_to_none=True)
        out = model(input_ids=inputs, labels=inputs)
        out.loss.backward()
        optimizer.step()
        # every rank holds as many tokens: the mean of the ranks' losses is the batch's
        batch_loss = out.loss.detach().clone()
        dist.all_reduce(batch_loss)
        losses.append(float(batch_loss) / dist.get_world_size())
        if mp.rank() == 0 and len(losses) % args.log_every == 0:
            print(f"step {len(losses):3d} | loss {losses[-1]:.3f} | load balance "
                  f"{out.aux_loss.item():.3f} | this rank holds "
                  f"{args.experts // mp.state.ep_size} of {args.experts} experts a layer",
                  flush=True)
        if len(losses) == args.steps:
            break
    if mp.rank() == 0:
        print(f"done: {len(losses)} steps; loss {losses[0]:.3f} -> {losses[-1]:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
