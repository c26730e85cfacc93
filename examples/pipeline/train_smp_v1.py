"""Pipeline-parallel training written for the SageMaker model parallel library (v1).

A byte-level next-character model learns Python's standard library source (it ships
with every Python, so nothing is downloaded). The script is an SMP v1 script: the
model is wrapped in smp.DistributedModel, the forward and backward live in an
@smp.step function, and the batch is split into microbatches that flow through the
pipeline stages. The one change from the SageMaker original is the import line.

Run it with 2 pipeline stages:

    echo '{"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "interleaved"}' > smp.json
    modelparallel run --nproc-per-node 2 --config smp.json examples/pipeline/train_smp_v1.py

On SageMaker the same keys go into the estimator's
distribution={"smdistributed": {"modelparallel": {"enabled": True, "parameters": {...}}}}.
"""

import argparse
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import modelparallel as smp  # was: import smdistributed.modelparallel.torch as smp


class PythonSourceBytes(Dataset):
    """(previous `context` bytes, next byte) pairs from the standard library's source."""

    def __init__(self, data, context):
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.context = context

    def __len__(self):
        return len(self.tokens) - self.context

    def __getitem__(self, i):
        return self.tokens[i:i + self.context], self.tokens[i + self.context]


def read_stdlib_source(max_bytes):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join(path.read_bytes() for path in sorted(stdlib.glob("*.py"))[:40])
    return data[:max_bytes]


class Block(nn.Module):
    """A residual MLP block; the pipeline is cut between blocks."""

    def __init__(self, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, context=16, embed=16, hidden=128, layers=4, vocab=256):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.fc_in = nn.Linear(context * embed, hidden)
        self.blocks = nn.Sequential(*[Block(hidden) for _ in range(layers)])
        self.norm = nn.LayerNorm(hidden)
        self.fc_out = nn.Linear(hidden, vocab)

    def forward(self, x):
        x = self.embed(x).flatten(1)
        x = F.gelu(self.fc_in(x))
        x = self.blocks(x)
        x = self.fc_out(self.norm(x))
        return F.log_softmax(x, dim=1)


# smdistributed: Define smp.step. Return any tensors needed outside.
@smp.step
def train_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="mean")
    model.backward(loss)
    return loss


# smdistributed: Define smp.step for evaluation.
@smp.step
def test_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="sum").item()  # sum up batch loss
    pred = output.argmax(dim=1, keepdim=True)  # get the index of the max log-probability
    correct = pred.eq(target.view_as(pred)).sum().item()
    return loss, correct


def train(args, model, device, train_loader, optimizer):
    model.train()
    losses = []
    step, epoch = 0, 0
    while step < args.steps:
        train_loader.sampler.set_epoch(epoch)
        for data, target in train_loader:
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            # smdistributed: the step returns a StepOutput with one loss per microbatch
            loss_mb = train_step(model, data, target)
            loss = loss_mb.reduce_mean()
            optimizer.step()
            losses.append(loss.item())
            step += 1
            if smp.rank() == 0 and (step == 1 or step % args.log_interval == 0):
                print(f"Train step {step:4d} [epoch {epoch}]\tLoss: {loss.item():.4f}",
                      flush=True)
            if step == args.steps:
                break
        epoch += 1
    return losses


def test(model, device, test_loader):
    model.eval()
    test_loss, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            loss_batch, correct_batch = test_step(model, data, target)
            test_loss += sum(loss_batch)
            correct += sum(correct_batch)
            count += len(target)
    # smdistributed: sum the data-parallel replicas' results
    totals = smp.allgather((test_loss, correct, count), smp.DP_GROUP)
    test_loss = sum(t[0] for t in totals) / sum(t[2] for t in totals)
    accuracy = sum(t[1] for t in totals) / sum(t[2] for t in totals)
    model.train()
    return test_loss, accuracy


def main():
    parser = argparse.ArgumentParser(description="SMP v1 pipeline-parallel example")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=64,
                        help="samples per data-parallel rank per step")
    parser.add_argument("--test-batch-size", type=int, default=256)
    parser.add_argument("--test-batches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--context", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--data-bytes", type=int, default=400_000)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--save", default="", help="save the full model's state_dict here")
    args = parser.parse_args()

    # smdistributed: initialize the backend (the configuration comes from the launcher)
    smp.init()

    # the same initial weights on every rank: each stage keeps its own part of them
    torch.manual_seed(args.seed)
    if torch.cuda.is_available():
        torch.cuda.set_device(smp.local_rank())
        device = torch.device("cuda", smp.local_rank())
    else:
        device = torch.device("cpu")

    data = read_stdlib_source(args.data_bytes)
    split = int(len(data) * 0.95)
    train_set = PythonSourceBytes(data[:split], args.context)
    test_set = PythonSourceBytes(data[split:], args.context)
    test_set = torch.utils.data.Subset(
        test_set, range(min(len(test_set), args.test_batches * args.test_batch_size)))

    # smdistributed: the ranks of one model replica (its pipeline stages) read the same
    # samples; each data-parallel replica reads its own share.
    train_sampler = DistributedSampler(train_set, num_replicas=smp.dp_size(),
                                       rank=smp.dp_rank(), shuffle=True, seed=args.seed,
                                       drop_last=True)
    test_sampler = DistributedSampler(test_set, num_replicas=smp.dp_size(),
                                      rank=smp.dp_rank(), shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              drop_last=True)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, sampler=test_sampler,
                             drop_last=True)

    model = Net(context=args.context, layers=args.layers).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    # smdistributed: the model is partitioned into pipeline stages at the first step
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(optimizer)

    if smp.rank() == 0:
        print(f"Net with {n_params} parameters; {len(train_set)} training samples; "
              f"pp_size {smp.pp_size()}, dp_size {smp.dp_size()}", flush=True)

    start = time.time()
    test_loss_before, _ = test(model, device, test_loader)
    losses = train(args, model, device, train_loader, optimizer)
    test_loss, accuracy = test(model, device, test_loader)

    # smdistributed: state_dict() gathers every stage's parameters; save on one rank
    model_dict = model.state_dict()
    if smp.rank() == 0:
        if args.save:
            torch.save(model_dict, args.save)
            print(f"Saved {len(model_dict)} tensors to {args.save}", flush=True)
        first, last = sum(losses[:5]) / len(losses[:5]), sum(losses[-5:]) / len(losses[-5:])
        print(f"Finished {len(losses)} steps in {time.time() - start:.1f}s: train loss "
              f"{first:.4f} -> {last:.4f}; test loss {test_loss_before:.4f} -> "
              f"{test_loss:.4f}, accuracy {100.0 * accuracy:.1f}%", flush=True)


if __name__ == "__main__":
    main()
