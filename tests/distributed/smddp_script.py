"""A script on SMDDP's APIs, run by test_smddp.py under torchrun with 2 processes.

It writes every check's outcome to OUT/rank<r>.json: a value (compared by the test) or
the traceback of a failure. Parity cases train a tiny MLP with SGD+momentum and compare
the loss of every step and every parameter with one process on the whole batch
(modelparallel.testing.parity_problems; an empty list is parity).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn

import modelparallel.dataparallel  # was: import smdistributed.dataparallel.torch.torch_smddp
from modelparallel.testing import parity_problems, train

results: dict[str, object] = {}


def check(name):
    def run(fn):
        try:
            results[name] = fn()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        return fn
    return run


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(4)]


def sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def mse(out, target):
    return nn.functional.mse_loss(out, target)


def parity(wrapped: nn.Module) -> list[str]:
    reference = train(model(), batches(), optimizer=sgd, loss_fn=mse)
    result = train(wrapped, batches(), optimizer=sgd, loss_fn=mse,
                   replica=(dist.get_rank(), dist.get_world_size()), group=dist.group.WORLD)
    return parity_problems(result, reference)


dist.init_process_group(backend="smddp")
rank, world = dist.get_rank(), dist.get_world_size()
world_group = dist.group.WORLD
results["backend"] = dist.get_backend()
results["cpu_backend"] = type(world_group._get_backend(torch.device("cpu"))).__name__


@check("collectives")
def _():
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    parts = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(parts, torch.tensor([float(rank)]))
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=1)
    scattered = torch.zeros(1)
    dist.reduce_scatter_tensor(scattered, torch.tensor([1.0, 2.0]))
    objects: list = [None] * world
    dist.all_gather_object(objects, {"rank": rank})
    dist.barrier()
    return [t.item(), [p.item() for p in parts], b.item(), scattered.item(), objects]


@check("new_group")
def _():
    pair = dist.new_group([0, 1])
    t = torch.ones(1)
    dist.all_reduce(t, group=pair)
    singles = [dist.new_group([r]) for r in range(world)]
    s = torch.tensor([float(rank)])
    dist.all_reduce(s, group=singles[rank])
    return [dist.get_backend(pair), t.item(), s.item()]


@check("ddp_parity")
def _():
    from torch.nn.parallel import DistributedDataParallel as DDP

    return parity(DDP(model()))


@check("fsdp1_parity")
def _():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return parity(FSDP(model(), use_orig_params=True, device_id=torch.device("cpu")))


import modelparallel as mp  # noqa: E402


@check("mp_init_reuses_group")
def _():
    mp.init({})
    return [dist.group.WORLD is world_group, dist.get_backend(), mp.size(), mp.rdp_size()]


@check("mp_shard_parity")
def _():
    return parity(mp.shard(model()))


@check("legacy_api")
def _():
    import modelparallel.dataparallel as sdist  # was: smdistributed.dataparallel.torch.distributed

    t = torch.tensor([float(rank)])
    sdist.all_reduce(t, op=sdist.ReduceOp.AVERAGE)
    a = torch.tensor([float(rank) * 2])
    sdist.all_reduce(a, op=sdist.ReduceOp.AVERAGE, async_op=True).wait()
    m = torch.tensor([float(rank)])
    sdist.all_reduce(m, op=sdist.ReduceOp.MAX)
    try:
        sdist.all_reduce(torch.tensor([rank]), op=sdist.ReduceOp.AVERAGE)
        integer = "accepted"
    except TypeError as e:
        integer = str(e)
    swapped = torch.zeros(2)  # rank r sends [10r, 10r+1]: piece i goes to rank i
    sdist.all_to_all_single(swapped, torch.tensor([10.0 * rank, 10.0 * rank + 1]))
    return [t.item(), a.item(), m.item(), integer, sdist.get_local_rank(), sdist.is_available(),
            sdist.get_world_size(group=sdist.group.WORLD), sdist.get_local_size(),
            sdist.is_initialized(), swapped.tolist()]


@check("legacy_ddp_parity")
def _():
    from modelparallel.dataparallel import DistributedDataParallel

    wrapped = DistributedDataParallel(model(), device_ids=[rank], output_device=rank,
                                      broadcast_buffers=False, process_group=None,
                                      bucket_cap_mb=25)
    return parity(wrapped) + ([] if wrapped.broadcast_buffers is False
                              else ["broadcast_buffers not passed"])


with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
dist.destroy_process_group()
