"""Train a small Llama on long windows of Python source, each sequence split over ranks.

    modelparallel run --nproc-per-node 2 examples/context_parallel/train_llama.py
    modelparallel run --nproc-per-node 4 examples/context_parallel/train_llama.py \\
        --hybrid-shard-degree 2 --cp-comm-type all_gather

With ``context_parallel_degree`` 2 each rank holds two of the four chunks of every
sequence (SMP's load-balanced split, made by ``mp.split_for_context_parallel``):
activations per rank are about half of one process's, and ring attention over the
context-parallel group makes the result exactly one process's on the whole sequence
(docs/context-parallel.md). The ranks of a context-parallel group read the same samples
from ``mp.data`` and shard the model together (``hybrid_shard_degree`` is a multiple of
the degree, or 0).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import modelparallel as mp
from modelparallel.data.datasets import ByteChunks, python_source_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=2, help="sequences per data-parallel group")
    p.add_argument("--seq-len", type=int, default=1024, help="whole sequence length")
    p.add_argument("--context-parallel-degree", type=int, default=2)
    p.add_argument("--hybrid-shard-degree", type=int, default=0)
    p.add_argument("--cp-comm-type", choices=("p2p", "all_gather"), default="p2p")
    p.add_argument("--log-every", type=int, default=5)
    args = p.parse_args()

    mp.init({"context_parallel_degree": args.context_parallel_degree,
             "hybrid_shard_degree": args.hybrid_shard_degree})
    torch.manual_seed(0)  # the same initial weights on every rank
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.seq_len, use_cache=False,
                         attn_implementation="sdpa")
    model = mp.transform(LlamaForCausalLM(config), cp_comm_type=args.cp_comm_type)
    mp.shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    loader = mp.data.DataLoader(ByteChunks(python_source_bytes(2_000_000), args.seq_len),
                                batch_size=args.batch_size, drop_last=True)
    losses: list[float] = []
    for inputs, _ in loader:
        ids = mp.split_for_context_parallel(inputs)  # this rank's two chunks of each row
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss  # labels shifted on the whole rows
        loss.backward()
        optimizer.step()
        # each rank's loss is its share of the batch's mean times cp: the mean over all
        # ranks is the batch's mean
        batch_loss = loss.detach().clone()
        dist.all_reduce(batch_loss)
        losses.append(float(batch_loss) / dist.get_world_size())
        if mp.rank() == 0 and len(losses) % args.log_every == 0:
            print(f"step {len(losses):3d} | loss {losses[-1]:.3f} | {ids.shape[1]} of "
                  f"{args.seq_len} positions on this rank", flush=True)
        if len(losses) == args.steps:
            break
    if mp.rank() == 0:
        print(f"done: {len(losses)} steps; loss {losses[0]:.3f} -> {losses[-1]:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
