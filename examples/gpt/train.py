"""Train a small GPT on Python's own source code with hybrid sharded data parallelism.

    modelparallel run --nproc-per-node 4 examples/gpt/train.py
    modelparallel run --nproc-per-node 4 examples/gpt/train.py --tensor-parallel-degree 2
    modelparallel run --nproc-per-node 4 examples/gpt/train.py --precision bf16

By default 4 processes form 2 replicas x 2 shards (hybrid_shard_degree 2): each
parameter is sharded over 2 ranks (FSDP2) and the 2 shard groups replicate each
other. Any other layout is one option away (--hybrid-shard-degree 0 shards over all
ranks, 1 replicates) or comes from a config file (modelparallel run --config ...).
With --tensor-parallel-degree 2 each block is split over 2 ranks (heads and MLP
columns, vocabulary-parallel embedding and LM head with a parallel cross-entropy)
and the data-parallel layout applies to what remains: 4 ranks = 2 TP x 2 shards.
With --precision bf16 or fp16 the forward and backward compute in that type with
float32 parameters and optimizer state; fp16 scales the loss with mp.LossScaler.
Each run leaves a run directory (runs/DATE-train/): the logs, every step's metrics,
TensorBoard events and report.html (docs/launcher.md#run-directories).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.distributed.tensor import DTensor

import modelparallel as mp
from modelparallel.data.datasets import ByteChunks, python_source_bytes, train_val_split
from modelparallel.models import GPT, GPTConfig
from modelparallel.models.gpt import lm_loss


def scalar(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain tensor (under loss parallelism it is a replicated DTensor)."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per data-parallel "
                                                              "rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hybrid-shard-degree", type=int, default=2)
    p.add_argument("--tensor-parallel-degree", type=int, default=1)
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--text-bytes", type=int, default=2_000_000)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--metrics", default=None,
                   help="also write every step's metrics (JSON lines, rank 0) here; they "
                        "always go to the run directory's metrics.jsonl under modelparallel "
                        "run")
    return p.parse_args()


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, data: ByteChunks, batches: int = 8,
                  batch_size: int = 16) -> float:
    """Mean loss on the same held-out windows on every rank."""
    model.eval()
    total = 0.0
    for b in range(batches):
        rows = [data[(b * batch_size + i) % len(data)] for i in range(batch_size)]
        inputs, targets = (torch.stack(t) for t in zip(*rows, strict=True))
        with mp.loss_parallel():
            total += scalar(lm_loss(model(inputs), targets)).item()
    model.train()
    return total / batches


def main() -> None:
    args = parse_args()
    tp = args.tensor_parallel_degree
    # prescaled_batch: the ranks of a tensor-parallel group read the same batch, which
    # loss_parallel needs (docs/tensor-parallel.md).
    mp.init({"hybrid_shard_degree": args.hybrid_shard_degree, "tensor_parallel_degree": tp,
             "prescaled_batch": tp > 1, "bf16": args.precision == "bf16",
             "fp16": args.precision == "fp16"})
    train_text, val_text = train_val_split(python_source_bytes(args.text_bytes))
    train_data, val_data = ByteChunks(train_text, args.seq_len), ByteChunks(val_text,
                                                                            args.seq_len)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT(GPTConfig(vocab_size=ByteChunks.vocab_size, max_seq_len=args.seq_len,
                          d_model=args.d_model, n_layers=args.layers, n_heads=args.heads))
    n_params = sum(p.numel() for p in model.parameters())
    mp.transform(model, loss_parallel=True)  # a no-op when tensor_parallel_degree is 1
    mp.shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    # fp16 gradients underflow without loss scaling (overflowing steps are skipped)
    scaler = mp.LossScaler(init_scale=2.0 ** 16) if args.precision == "fp16" else None
    loader = mp.data.DataLoader(train_data, batch_size=args.batch_size, seed=0, drop_last=True)
    metrics = mp.observe.StepMetrics(jsonl=args.metrics, print_every=args.log_every,
                                     total_steps=args.steps)  # a progress bar with an ETA
    global_batch = args.batch_size * mp.rdp_size()  # one batch per model replica
    if mp.rank() == 0:
        print(f"{mp.state.topology.describe()}; GPT with {n_params / 1e6:.2f}M parameters; "
              f"{len(train_text) / 1e6:.1f} MB of Python source; global batch {global_batch} x "
              f"{args.seq_len} bytes", flush=True)

    before = held_out_loss(model, val_data)
    start, step, epoch = time.perf_counter(), 0, 0
    while step < args.steps:
        loader.set_epoch(epoch)
        for inputs, targets in loader:
            with metrics.step(samples=global_batch, tokens=global_batch * args.seq_len) as rec:
                optimizer.zero_grad(set_to_none=True)
                with mp.loss_parallel():  # the loss and its backward on vocabulary shards
                    loss = lm_loss(model(inputs), targets)
                    (scaler.scale(loss) if scaler else loss).backward()
                if scaler:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                rec.loss = scalar(loss)
            step += 1
            if step == args.steps:
                break
        epoch += 1
    after = held_out_loss(model, val_data)
    if mp.rank() == 0:
        first, last = metrics.records[0].loss, metrics.records[-1].loss
        print(f"done: {args.steps} steps in {time.perf_counter() - start:.0f}s; training loss "
              f"{first:.3f} -> {last:.3f}; held-out loss {before:.3f} -> {after:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
