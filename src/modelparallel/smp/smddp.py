"""SMDDP's two APIs on PyTorch's own collectives.

- **The current API** (SMDDP >= 1.4): ``import smdistributed.dataparallel.torch.torch_smddp``
  registers a ``torch.distributed`` backend named ``"smddp"``, so that
  ``dist.init_process_group(backend="smddp")`` works. Here :func:`register_backend` (run
  when ``modelparallel.dataparallel`` is imported, which that path maps to) registers it
  with ``torch.distributed.Backend.register_backend``: on a machine with CUDA every
  ``smddp`` group runs NCCL (CUDA tensors, as SMDDP itself), on a machine without it
  gloo (CPU tensors). ``new_group``, DDP, FSDP (1 and 2), DeviceMesh and ``mp.init()``
  work on it.

  (One backend name cannot run gloo for CPU tensors and NCCL for CUDA tensors of the
  same group: torch creates a single backend object for all the devices of a backend
  name. For both, use ``backend="cpu:gloo,cuda:nccl"``.)
- **The deprecated API** (SMDDP 1.0-1.3, ``smdistributed.dataparallel.torch.distributed``):
  :class:`ReduceOp` with ``AVERAGE`` and :func:`all_reduce` accepting it.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist

BACKEND = "smddp"
_lock = threading.Lock()


def register_backend() -> None:
    """Register the ``"smddp"`` backend with torch.distributed (idempotent; a backend of
    that name registered by someone else, e.g. the real SMDDP, is left alone).

    Its device is ``cuda`` (NCCL) when CUDA is available, else ``cpu`` (gloo).
    """
    with _lock:
        if BACKEND in dist.Backend.backend_list:
            return
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dist.Backend.register_backend(BACKEND, _create_backend, extended_api=True,
                                      devices=[device])


def _create_backend(options: Any, backend_options: Any = None) -> Any:
    """torch calls this for each new ``smddp`` group: NCCL with CUDA, else gloo (set up
    as torch's own ``nccl``/``gloo`` branches set them up)."""
    store, rank, size = options.store, options.group_rank, options.group_size
    timeout: datetime.timedelta = options.timeout
    if torch.cuda.is_available():
        nccl = backend_options if isinstance(backend_options, dist.ProcessGroupNCCL.Options) \
            else dist.ProcessGroupNCCL.Options()
        if backend_options is None:
            nccl.is_high_priority_stream = False
        nccl._timeout = timeout  # what torch's own NCCL branch sets; no public setter
        nccl.global_ranks_in_group = options.global_ranks_in_group
        nccl.group_name = options.group_id
        return dist.ProcessGroupNCCL(store, rank, size, nccl)
    gloo = dist.ProcessGroupGloo(store, rank, size, timeout=timeout)
    gloo.options.global_ranks_in_group = options.global_ranks_in_group
    gloo.options.group_name = options.group_id
    return gloo


# -- the deprecated (<= 1.3) API -------------------------------------------------------------

class _Average:
    """``ReduceOp.AVERAGE``: a sum divided by the group's size."""

    def __repr__(self) -> str:
        return "ReduceOp.AVERAGE"


class ReduceOp:
    """SMDDP 1.x's reduce operations: ``AVERAGE``, ``SUM``, ``MIN``, ``MAX`` (and torch's
    ``PRODUCT``). Every value but ``AVERAGE`` is torch's own ``ReduceOp``."""

    AVERAGE = _Average()
    SUM = dist.ReduceOp.SUM
    MIN = dist.ReduceOp.MIN
    MAX = dist.ReduceOp.MAX
    PRODUCT = dist.ReduceOp.PRODUCT


class _AveragingWork:
    """The handle of an asynchronous AVERAGE: waiting divides the summed tensor."""

    def __init__(self, work: Any, tensor: torch.Tensor, size: int) -> None:
        self._work, self._tensor, self._size, self._done = work, tensor, size, False

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        ok = self._work.wait() if timeout is None else self._work.wait(timeout)
        if not self._done:
            self._tensor.div_(self._size)
            self._done = True
        return ok

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def get_future(self) -> torch.futures.Future:
        def divide(_: torch.futures.Future) -> torch.Tensor:
            self.wait()
            return self._tensor

        return self._work.get_future().then(divide)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM,
               group: dist.ProcessGroup | None = None, async_op: bool = False) -> Any:
    """``torch.distributed.all_reduce``, plus SMDDP's ``ReduceOp.AVERAGE`` (the mean over
    the group, on every backend: a sum divided by the group's size)."""
    if not isinstance(op, _Average):
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    if not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"all_reduce with ReduceOp.AVERAGE needs a floating-point tensor, "
                        f"got {tensor.dtype}; use ReduceOp.SUM and divide as you need")
    size = dist.get_world_size(group)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    if async_op:
        return _AveragingWork(work, tensor, size)
    tensor.div_(size)
    return None
