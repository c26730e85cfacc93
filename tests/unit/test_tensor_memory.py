"""PeakTensorMemory: exact peaks of CPU tensor bytes, computed by hand."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from modelparallel.observe import PeakTensorMemory
from modelparallel.testing import WorkerGroup


def empty(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def test_the_peak_of_a_sequence_of_allocations_and_frees():
    with PeakTensorMemory() as mem:
        a = empty(1000)
        b = empty(200)  # 1200 alive: the peak
        del a  # 200
        c = empty(300)  # 500
    assert mem.peak_bytes - mem.start_bytes == 1200
    assert mem.end_bytes - mem.start_bytes == 500
    assert mem.exact and mem.unseen_free_bytes == 0 and mem.events == 4
    assert b.numel() + c.numel() == 500


def test_a_freed_tensor_stops_counting():
    with PeakTensorMemory() as mem:
        for _ in range(5):
            t = empty(4096)  # the next one is made before this one goes: 2 alive at most
        del t
    assert mem.peak_bytes - mem.start_bytes == 2 * 4096
    assert mem.end_bytes == mem.start_bytes


def test_tensors_alive_at_the_start_count_once_however_many_views():
    with PeakTensorMemory() as without:
        pass
    kept = empty(8192)
    views = [kept[10:], kept.view(2, 4096), kept.view(torch.float32)]
    with PeakTensorMemory() as mem:
        extra = empty(100)
    assert mem.start_bytes - without.start_bytes == 8192
    assert mem.peak_bytes == mem.start_bytes + 100 == mem.end_bytes
    assert len(views) == 3 and extra.numel() == 100


def test_a_tensor_alive_at_the_start_and_freed_inside_is_an_unseen_free():
    before = empty(4096)
    with PeakTensorMemory() as mem:
        del before  # allocated before any profiler watched: the allocator reports no free
    assert mem.unseen_free_bytes == 4096 and not mem.exact
    assert mem.end_bytes == mem.start_bytes - 4096
    assert mem.peak_bytes == mem.start_bytes  # an upper bound here, and exact


def test_a_linear_training_step():
    """Bytes by hand: Linear(64, 32) in float32 on a (16, 64) batch, loss = out.sum()."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    x = torch.ones(16, 64)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    f32 = 4
    out, scalar = 16 * 32 * f32, f32
    grad_w, grad_b = 32 * 64 * f32, 32 * f32
    steps = []
    for _ in range(2):
        with PeakTensorMemory() as mem:
            opt.zero_grad()
            loss = lin(x).sum()
            loss.backward()
            opt.step()
        steps.append(mem)
    first, second = steps
    # forward: out (freed once sum has it: sum saves nothing), loss; backward: the
    # seed gradient 1.0 of loss, grad_w = grad_out^T @ x, for which the expanded
    # grad_out is made contiguous (out's bytes) while grad_w exists: the peak
    assert first.peak_bytes - first.start_bytes == scalar + scalar + grad_w + out
    # then the contiguous grad_out and the seed go; grad_b stays; loss stays
    assert first.end_bytes - first.start_bytes == scalar + grad_w + grad_b
    assert first.exact
    # the second step starts with the grads and loss of the first, frees them
    # (zero_grad, the new loss) and reaches the same peak
    assert second.start_bytes == first.end_bytes
    assert second.peak_bytes == first.peak_bytes and second.exact
    assert second.end_bytes == second.start_bytes


def dtensor_bytes() -> tuple[int, int]:
    """Live tensor bytes that distributing a 4 KB tensor over one rank adds."""
    mesh = DeviceMesh("cpu", [0])
    with PeakTensorMemory() as without:
        pass
    weight = distribute_tensor(torch.ones(1024), mesh, [Shard(0)])
    with PeakTensorMemory() as mem:
        pass
    return mem.start_bytes - without.start_bytes, weight.to_local().numel()


def test_a_dtensor_counts_its_local_shard_not_the_wrapper():
    # in a process of its own: the test session's process holds what earlier tests'
    # collectives left (torch keeps unwaited work and its tensors), which can land here
    with WorkerGroup(1) as group:
        [(added, local)] = group.run(dtensor_bytes)
    assert (added, local) == (4096, 1024)
