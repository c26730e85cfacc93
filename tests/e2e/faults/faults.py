"""Faults injected into a run (tests/e2e/test_doctor.py): ``python faults.py KIND TIMEOUT``
under ``modelparallel run --nproc-per-node 2`` (3 where a majority names the rank that
diverged). Rank 1 is the one that misbehaves; the lines the doctor must name carry a
``# <-`` marker the test looks up."""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import modelparallel as mp

kind, timeout = sys.argv[1], float(sys.argv[2])
mp.init({"collective_timeout": timeout})  # also bounds the ranks' start-up skew
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
    other = dist.new_group(list(range(dist.get_world_size())))  # same ranks, another group
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
