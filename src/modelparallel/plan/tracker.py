"""``StepTracker``: what one simulated step allocates, runs and computes.

It follows every storage the step's operations create until it is freed and keeps
the peak. FSDP2 frees and refills storage with ``UntypedStorage.resize_``, which no
dispatch mode sees: the tracker wraps it while active (as torch's own ``MemTracker``
does; that one's per-module statistics refuse a module run twice in a step, as every
pipeline microbatch runs it, and its gradient hooks fail under the pipeline's
``autograd.grad``).

Collectives on gloo (the CPU backend) allocate working copies through the CPU allocator
while they run: ``GLOO_WORKSPACE`` gives their size, measured with torch 2.13 by
``tests/distributed/test_plan_gloo_workspace.py`` (which fails if gloo changes). A copy
is freed by gloo's own thread, which may happen after the call has returned and the
step has gone on, even into the next step: so two peaks are kept, ``peak`` (each copy
gone when its call returns) and ``peak_late`` (the copies of a group's last
``GLOO_THREADS`` calls still held — gloo runs a group's work on that many threads, and
each holds its call's copy until it lets the work go) — a real step's peak lies between
them, by timing. NCCL works in buffers of its own, outside PyTorch's allocator: there
the two are equal.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from modelparallel.plan.fake_world import GROUPED_MM, building_mesh

GLOO_THREADS = 2  # ProcessGroupGloo's worker threads per group (torch's default)
# c10d operation -> (argument holding the tensors, working copies of their bytes)
GLOO_WORKSPACE = {
    "_reduce_scatter_base_": (1, 1),  # the whole input, flattened
    "_allgather_base_": (0, 1),  # the whole output
    "allgather_": (0, 1),  # the outputs, flattened
}


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, *args: Any, out_val: torch.Tensor,
                      **kwargs: Any) -> int:
    """A grouped matmul's multiply-adds x 2: each group's rows times its matrix. Two 2-D
    operands (a weight's gradient) contract their jagged dim, split into the groups."""
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * out_val.numel() * a.shape[-1]


# torch's FLOP formulas, with its CPU flash attention counted as its GPU one (the same
# arithmetic; torch's table lacks the CPU kernels, which the planner runs on) and the
# grouped matmul of mixture-of-experts layers (which it lacks)
_FLOPS = {
    GROUPED_MM: _grouped_mm_flops,
    **flop_registry,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        flop_registry[torch.ops.aten._scaled_dot_product_flash_attention],
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        flop_registry[torch.ops.aten._scaled_dot_product_flash_attention_backward],
}


class StepTracker(TorchDispatchMode):
    """The peak of live tensor storage while inside, and the operations and FLOPs run
    (counted as torch's ``FlopCounterMode`` counts them, without its module tracking,
    which keeps activation-checkpointed tensors alive longer than training does and
    fails under the pipeline's ``autograd.grad``); entering again starts a new peak
    from what is live then. Every storage an operation returns is counted until it is
    freed; a DTensor is counted by its local tensor (the mode lets DTensor unwrap first)
    and DTensor's own shape propagation (a nested fake mode) is not counted."""

    def __init__(self, gloo: bool = False, host: bool = False) -> None:
        super().__init__()
        self.gloo = gloo  # count gloo's working copies in collectives
        self.host = host  # the run's tensors are in host memory (it trains on CPU)
        self.live = 0
        self.peak_tensors = 0  # of tensor storage alone (no gloo copy): what NCCL sees
        self.peak = 0
        self.peak_late = 0  # with gloo's working copies freed as late as they can be
        # group -> bytes of the copies of its last GLOO_THREADS calls
        self._lingering: dict[str, deque[int]] = {}
        self.ops = 0  # operations seen (what a CPU step pays per-operation overhead for)
        self.flops = 0  # of the operations torch's FLOP counter knows (matmuls, attention)
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted
        self._fake_mode: Any = None
        self._resize: Any = None
        self._get_rng_state: Any = None

    def __enter__(self) -> StepTracker:
        self._fake_mode = active_fake_mode()
        self.peak_tensors = self.peak = self.live
        # the previous step's last copies may still be there (gloo's thread frees them)
        self.peak_late = self.live + self._held_late()
        self.ops = self.flops = 0
        self._resize = torch.UntypedStorage.resize_
        tracker, original = self, self._resize

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            # not an operation a dispatch mode sees: FSDP2 frees and refills parameter
            # storage this way
            result = original(storage, size)
            tracker._count(storage)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        self._get_rng_state = torch.get_rng_state

        def get_rng_state() -> torch.Tensor:
            # a copy of the CPU generator's state (5 KB), made outside the dispatcher: the
            # tensor-parallel randomness rule holds one per region it is inside
            state = tracker._get_rng_state()
            tracker._count(state.untyped_storage())
            return state

        torch.get_rng_state = get_rng_state
        super().__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        torch.get_rng_state = self._get_rng_state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented
        if func is torch.ops._c10d_functional.wait_tensor.default and self._fake_mode \
                and is_fake(args[0]):
            return args[0]  # its fake version returns a new tensor; the real one, its input
        # (a real tensor's wait runs: it takes the collective off torch's registry of
        # unwaited work, which would otherwise complain at exit)
        if self.gloo and func.namespace == "c10d":
            self._gloo_copies(func._opname, args)
        out = func(*args, **(kwargs or {}))
        mode = active_fake_mode()
        if mode is self._fake_mode:
            self.ops += 1
            count_flops = _FLOPS.get(func._overloadpacket)
            if count_flops is not None:
                self.flops += count_flops(*args, **(kwargs or {}), out_val=out)
            self._count_tensors(out)
        elif mode is None and self.host and building_mesh():
            # a device mesh's rank tensors (CPU, made for real): a CPU run's memory too
            self._count_tensors(out)
        return out

    def _count_tensors(self, out: Any) -> None:
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":  # meta: no memory
                self._count(t.untyped_storage())

    def _gloo_copies(self, op: str, args: Any) -> None:
        boxed = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
        if boxed is None:
            return
        if op not in GLOO_WORKSPACE:
            return
        key = dist.ProcessGroup.unbox(boxed).group_name  # the first script object: the group
        at, copies = GLOO_WORKSPACE[op]
        held = copies * sum(t.untyped_storage().nbytes() for t in pytree.tree_leaves(args[at])
                            if isinstance(t, torch.Tensor))
        self.peak = max(self.peak, self.live + held)
        self._lingering.setdefault(key, deque(maxlen=GLOO_THREADS)).append(held)
        self.peak_late = max(self.peak_late, self.live + self._held_late())

    def _held_late(self) -> int:
        return sum(sum(copies) for copies in self._lingering.values())

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        size = storage.nbytes()
        if key not in self._sizes:
            weakref.finalize(storage, self._free, key)
        self.live += size - self._sizes.get(key, 0)
        self._sizes[key] = size
        self.peak_tensors = max(self.peak_tensors, self.live)
        self.peak = max(self.peak, self.live)
        self.peak_late = max(self.peak_late, self.live + self._held_late())

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
