"""Faults injected into a 3-rank run (tests/e2e/test_doctor.py): ``python faults.py KIND``
under ``modelparallel run --nproc-per-node 3``. Rank 1 is the one that misbehaves; the
lines the doctor must name carry a ``# <-`` marker the test looks up."""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import modelparallel as mp

kind = sys.argv[1]
mp.init({"collective_timeout": 20})  # start-up on a loaded machine fits in it
rank = dist.get_rank()
x = torch.ones(4)
dist.barrier()  # everyone is up before the fault


def stall_in_user_code():
    if rank == 1:
        time.sleep(300)  # <- stall
    dist.all_reduce(x)  # <- wait


def stall_in_library_collective():
    model = mp.replicate(torch.nn.Linear(4, 4))  # DDP: its all-reduce runs in C++
    if rank == 1:
        time.sleep(300)  # <- stall
    model(x).sum().backward()  # <- wait


def skipped_collective():
    for step in range(3):
        if not (rank == 1 and step == 1):
            dist.all_reduce(x)  # <- skipped
    dist.all_reduce(x)  # <- wait


def extra_collective():
    if rank == 1:
        dist.all_reduce(x)  # <- extra
    for _ in range(2):
        dist.all_reduce(x)  # <- wait


def shape_mismatch():
    dist.all_reduce(torch.ones(2) if rank == 1 else x)  # <- mismatch


def dtype_mismatch():
    dist.all_reduce(x.double() if rank == 1 else x)  # <- mismatch


def wrong_group():
    other = dist.new_group([0, 1, 2])  # the same ranks, another group
    dist.all_reduce(x, group=other if rank == 1 else None)  # <- mismatch


def exception_on_one_rank():
    if rank == 1:
        raise ValueError("rank 1 cannot go on")  # <- raise
    dist.all_reduce(x)  # <- wait


def killed_rank():
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # <- kill
    dist.all_reduce(x)  # <- wait


def point_to_point_deadlock():
    if rank in (0, 1):
        dist.recv(x, src=1 - rank)  # <- recv
    dist.barrier()  # <- wait


globals()[kind]()
print(f"rank {rank} finished")
