"""An SMDDP script in the style of SageMaker's MNIST example: a small CNN under
PyTorch's own DistributedDataParallel, with the process group made by
`dist.init_process_group(backend="smddp")` after importing SMDDP's backend module.

It keeps SageMaker's import line; run it unchanged with

    modelparallel run --compat sagemaker --nproc-per-node 2 examples/sagemaker/smddp_cnn.py

or change the import to `import modelparallel.dataparallel` and drop `--compat`.
"""

import argparse
import json
import os

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401  registers "smddp"
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from common import image_batches, rows, write_results
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import StepLR


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.fc1 = nn.Linear(16 * 12 * 12, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.log_softmax(self.fc2(x), dim=1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    dist.init_process_group(backend="smddp")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.getenv("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else \
        torch.device("cpu")
    torch.manual_seed(0)
    model = DDP(Net().to(device), device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    losses = []
    for step, (data, target) in enumerate(image_batches(args.steps)):
        data = rows(data, rank, world_size).to(device)
        target = rows(target, rank, world_size).to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        scheduler.step()
        value = loss.detach().double()
        dist.all_reduce(value)
        losses.append(value.item() / world_size)
        if rank == 0:
            print(json.dumps({"step": step, "loss": losses[-1]}), flush=True)
    if rank == 0 and args.out:
        write_results(args.out, losses, model.module.state_dict())


if __name__ == "__main__":
    main()
