"""SMP v1's ``DistributedOptimizer``: the optimizer over what this rank holds."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from modelparallel.parallel.clip import clip_grad_norm_
from modelparallel.parallel.precision import LossScaler
from modelparallel.smp import registry
from modelparallel.smp.state import state
from modelparallel.topology import CommGroup


class DistributedOptimizer:
    """An optimizer over exactly the parameters this rank holds after partitioning.

    Create it after ``DistributedModel`` and before the first step, from an optimizer
    over ``model.parameters()``; parameters other stages hold are dropped at the split.
    With ``fp16`` it scales the loss (``model.backward`` multiplies by the scale) with a
    dynamic :class:`~modelparallel.parallel.precision.LossScaler` (``loss_scaler``, or
    the one passed in):
    ``step()`` unscales, skips a step whose gradients overflowed on any rank
    (``overflow`` says so) and adapts the scale; the scaler's state is part of
    ``state_dict()``. With ``sharded_data_parallel_degree`` > 1 ``step()`` first clips
    the gradients to the global norm ``sdp_gradient_clipping`` (0 disables), as SMP v1's
    sharded data parallelism does.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, loss_scaler: LossScaler | None = None):
        s = state.require("mp.DistributedOptimizer").context
        self.optimizer = optimizer
        self._filtered = False
        if loss_scaler is not None and s.config.half_precision != "fp16":
            raise ValueError("a loss_scaler is for fp16=True; the configuration trains in "
                             f"{s.config.half_precision or 'fp32'}, which needs none")
        if s.config.half_precision == "fp16" and loss_scaler is None:
            loss_scaler = LossScaler()
        self.loss_scaler = loss_scaler
        registry.set_optimizer(self)

    @property
    def overflow(self) -> bool:
        """Whether the last step's gradients overflowed (and the step was skipped)."""
        return self.loss_scaler is not None and self.loss_scaler.overflow

    def _filter(self) -> None:
        model = registry.model()
        if self._filtered or model is None or not model.partitioned:
            return
        held = {id(p) for p in model.local_parameters()}
        replaced = model.engine.replaced
        for group in self.optimizer.param_groups:  # tensor/data parallelism replaced some
            params = [replaced.get(id(p), p) for p in group["params"]]
            group["params"] = [p for p in params if id(p) in held]
        self._filtered = True

    def step(self, *args, **kwargs):
        self._filter()
        c = state.require("mp.DistributedOptimizer.step").context.config
        if self.loss_scaler is not None and self.loss_scaler.unscale_(self.optimizer):
            self.loss_scaler.update()  # skipped: the gradients overflowed somewhere
            return None
        model = registry.model()
        if c.sharded_data_parallel_degree > 1 and c.sdp_gradient_clipping > 0:
            clip_grad_norm_(model if model is not None else self._params(),
                            c.sdp_gradient_clipping)
        result = self.optimizer.step(*args, **kwargs)
        if self.loss_scaler is not None:
            self.loss_scaler.update()
        return result

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._filter()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def local_state_dict(self) -> dict[str, Any]:
        self._filter()
        sd = self.optimizer.state_dict()
        if self.loss_scaler is not None:
            sd["loss_scaler"] = self.loss_scaler.state_dict()
        return sd

    def state_dict(self) -> list[dict[str, Any]]:
        """Every pipeline stage's optimizer state (SMP gathers them), stage order."""
        s = state.require("mp.DistributedOptimizer").context
        local = self.local_state_dict()
        if s.topology.pp == 1:
            return [local]
        parts: list[Any] = [None] * s.topology.pp
        dist.all_gather_object(parts, local, group=s.process_group(CommGroup.PP_GROUP))
        return parts

    def load_state_dict(self, state_dict) -> None:
        self._filter()
        if isinstance(state_dict, list):
            s = state.require("mp.DistributedOptimizer").context
            state_dict = state_dict[s.topology.coordinate(s.rank)["pp"]]
        state_dict = dict(state_dict)
        scaler = state_dict.pop("loss_scaler", None)
        if scaler is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(scaler)
        self.optimizer.load_state_dict(state_dict)

    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer, over exactly the parameters this rank holds (what
        checkpoints save: ``checkpoint.protocol.WrappedOptimizer``)."""
        self._filter()
        return self.optimizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)
