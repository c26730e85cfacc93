"""The planner's table of gloo's working copies (``plan/tracker.GLOO_WORKSPACE``): each
collective, run for real on 2 gloo ranks, allocates exactly that many copies of its
tensors beyond them (measured from the CPU allocator), and the others none."""

import torch
import torch.distributed as dist

from modelparallel.plan.tracker import GLOO_WORKSPACE

N = 2**16  # floats in the whole (unsharded) tensor


def extra_bytes() -> dict[str, float]:
    """Each collective's allocation beyond its own tensors, in whole-tensor bytes."""
    from modelparallel.observe.tensor_memory import PeakTensorMemory

    full, half = torch.randn(N), torch.randn(N // 2)
    whole, shard, parts = torch.empty(N), torch.empty(N // 2), [torch.empty(N // 2)] * 2
    calls = {  # outputs made beforehand: only what the collective allocates counts
        "_reduce_scatter_base_": lambda: dist.reduce_scatter_tensor(shard, full),
        "_allgather_base_": lambda: dist.all_gather_into_tensor(whole, half),
        "allgather_": lambda: dist.all_gather(parts, half),
        "allreduce_": lambda: dist.all_reduce(full),
        "broadcast_": lambda: dist.broadcast(full, 0),
    }
    found = {}
    for op, call in calls.items():
        call()  # gloo's first call on a group sets things up
        with PeakTensorMemory() as memory:
            call()
        found[op] = (memory.peak_bytes - memory.start_bytes) / (N * 4)
    return found


def test_gloo_allocates_what_the_planner_counts(workers):
    for found in workers(2).run(extra_bytes):
        # every tensor here is the whole size or half of it; a working copy is the whole
        expected = {op: float(GLOO_WORKSPACE.get(op, (None, 0))[1]) for op in found}
        assert found == expected
