"""SMP v1's ``smp.amp.GradScaler``: torch's gradient scaler for ranks that hold
different parts of one model.

torch's ``GradScaler`` decides from this rank's gradients alone whether to skip a step
and how to change the scale. When the ranks hold different parts (pipeline stages,
tensor-parallel or FSDP shards) one rank's overflow must skip the step everywhere, or
the replicas drift apart; and a pipeline stage that never computes the loss never calls
``scale()``. This scaler agrees on every decision over all ranks (one all-reduce of
one number per step) and starts its scale on ranks that never scaled a loss, so the
scale is the same everywhere, as SMP's does over the pipeline. In one process it is
torch's. Use it as torch's::

    scaler = smp.amp.GradScaler()

    @smp.step
    def train_step(model, x, y):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        model.backward(scaler.scale(loss))
        return loss

    train_step(model, x, y)
    scaler.step(optimizer)   # unscales; skips on every rank if any rank overflowed
    scaler.update()
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from modelparallel.notices import notice
from modelparallel.smp.state import state


def _default_device() -> str:
    """The device this rank trains on (before ``smp.init``: a GPU if there is one)."""
    return state.device.type if state.initialized else \
        ("cuda" if torch.cuda.is_available() else "cpu")


class GradScaler(torch.amp.GradScaler):
    """``torch.cuda.amp.GradScaler``'s arguments; ``device`` defaults to this rank's
    device (a script written for CUDA runs on a machine without one: the scaler then
    works on the CPU, said once)."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True, *, device: str | None = None):
        if device is None:
            device = _default_device()
        elif device == "cuda" and not torch.cuda.is_available():
            notice("smp.amp.GradScaler(device='cuda'): no GPU here; scaling on the cpu")
            device = "cpu"
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)

    # torch's GradScaler keeps its scale in private attributes (``_scale``,
    # ``_growth_tracker``, ``_per_optimizer_states``) and unscales in ``_unscale_grads_``;
    # the overrides below are the one place that relies on them (checked by
    # tests/unit/test_smp_optimizers.py::test_grad_scaler_in_one_process_is_torchs and the
    # pipeline case of tests/distributed/test_smp_v1_surface.py).
    def _start(self) -> None:
        """A rank that never called scale() (a pipeline stage without the loss)."""
        if self._enabled and self._scale is None:
            self._lazy_init_scale_growth_tracker(torch.device(self._device))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self._start()
        super().unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        self._start()
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        self._start()
        super().update(new_scale)

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool,
                        ) -> dict[torch.device, torch.Tensor]:
        """Unscale this rank's part of every gradient (a DTensor's local shard) and
        agree on ``found_inf`` over all ranks. Under ``mp.DistributedOptimizer`` with
        ``shard_optimizer_state`` every gradient the rank holds is unscaled, not only
        those whose optimizer state it keeps."""
        held = getattr(optimizer, "held_parameters", None)
        params = held() if callable(held) else \
            [p for g in optimizer.param_groups for p in g["params"]]
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        with torch.no_grad():
            for p in params:
                if p.grad is None:
                    continue
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                if grad.is_sparse:
                    raise ValueError("smp.amp.GradScaler does not unscale sparse gradients")
                by_kind[(grad.device, grad.dtype)].append(grad)
            for (device, _), grads in by_kind.items():
                part = torch.zeros_like(found_inf, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, part,
                                                                 inv_scale.to(device))
                found_inf += part.to(found_inf.device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                agreed = found_inf.clamp(max=1.0)
                if agreed.device.type == "cpu" and dist.get_backend() == "nccl":
                    agreed = agreed.cuda()
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
                found_inf.copy_(agreed.to(found_inf.device))
        return {found_inf.device: found_inf}


__all__ = ["GradScaler"]
