"""Train a small GPT on lines of Python source: rows of uneven length, padded.

    modelparallel run --nproc-per-node 2 examples/gpt/train_padded.py
    modelparallel run --nproc-per-node 2 examples/gpt/train_padded.py --tensor-parallel-degree 2

Each row is one line of the standard library's source, padded to --seq-len; the labels
of the padding are -100. A plain mean loss (cross_entropy's default) on each rank would
average the ranks' means, so a rank holding short lines would weigh as much as one
holding long lines. The summed loss divided by mp.global_token_count(labels) trains
exactly what one process trains on the whole batch with a token mean
(docs/data-parallel.md#token-mean-losses-with-padding-mpglobal_token_count).
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

import modelparallel as mp
from modelparallel.data.datasets import python_source_bytes
from modelparallel.models import GPT, GPTConfig


class Lines(torch.utils.data.Dataset):
    """The non-blank lines of ``text`` as byte tensors, at most ``seq_len + 1`` long."""

    def __init__(self, text: bytes, seq_len: int):
        self.lines = [line[:seq_len + 1] for line in text.split(b"\n") if len(line.strip()) > 1]

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(list(self.lines[i]))


def pad(rows: list[torch.Tensor], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, next-byte labels), each row padded to ``seq_len``; padding labels -100."""
    inputs = torch.zeros(len(rows), seq_len, dtype=torch.long)
    labels = torch.full((len(rows), seq_len), -100, dtype=torch.long)
    for i, row in enumerate(rows):
        inputs[i, :len(row) - 1], labels[i, :len(row) - 1] = row[:-1], row[1:]
    return inputs, labels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16, help="lines per data-parallel rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--tensor-parallel-degree", type=int, default=1)
    p.add_argument("--log-every", type=int, default=25)
    args = p.parse_args()

    mp.init({"tensor_parallel_degree": args.tensor_parallel_degree})
    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT(GPTConfig(vocab_size=256, max_seq_len=args.seq_len, d_model=64, n_layers=2,
                          n_heads=4))
    mp.transform(model)  # a no-op when tensor_parallel_degree is 1
    mp.shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    loader = mp.data.DataLoader(Lines(python_source_bytes(1_000_000), args.seq_len),
                                batch_size=args.batch_size, drop_last=True,
                                collate_fn=functools.partial(pad, seq_len=args.seq_len))
    losses: list[float] = []
    for inputs, labels in loader:
        optimizer.zero_grad(set_to_none=True)
        logits = model(inputs)
        loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        loss = loss_sum / mp.global_token_count(labels)  # not the mean of this rank's lines
        loss.backward()
        optimizer.step()
        # the batch's token mean: the losses of the data-parallel ranks, averaged
        batch_loss = loss.detach().clone()
        dist.all_reduce(batch_loss, group=mp.get_dp_process_group())
        losses.append(float(batch_loss) / mp.dp_size())
        tokens = int(mp.global_token_count(labels, count=True))  # collective: every rank
        if mp.rank() == 0 and len(losses) % args.log_every == 0:
            print(f"step {len(losses):4d} | loss {losses[-1]:.3f} | {tokens} tokens", flush=True)
        if len(losses) == args.steps:
            break
    if mp.rank() == 0:
        print(f"done: {len(losses)} steps; token-mean loss {losses[0]:.3f} -> {losses[-1]:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
