"""SMP v1's ``DistributedOptimizer``: the optimizer over what this rank holds."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from modelparallel.parallel.clip import clip_grad_norm_
from modelparallel.parallel.optimizer_sharding import OptimizerStateSharding
from modelparallel.parallel.precision import LossScaler
from modelparallel.smp import registry
from modelparallel.smp.state import state
from modelparallel.smp.v1 import wrapped_optimizer
from modelparallel.topology import CommGroup


class DistributedOptimizer(wrapped_optimizer.WrappedTorchOptimizer):
    """An optimizer over exactly the parameters this rank holds after partitioning.

    Create it after ``DistributedModel`` and before the first step, from an optimizer
    over ``model.parameters()``; parameters other stages hold are dropped at the split.
    It is a ``torch.optim.Optimizer`` whose ``param_groups`` and ``state`` are the
    wrapped optimizer's (``optimizer.optimizer``): learning-rate schedulers take either.

    With ``fp16`` it scales the loss (``model.backward`` multiplies by the scale) as SMP
    v1's ``FP16_Optimizer``: ``static_loss_scale`` (default 1.0), or with
    ``dynamic_loss_scale=True`` a dynamic scale shaped by ``dynamic_loss_args``
    (``init_scale`` 2**32, ``scale_factor`` 2, ``scale_window`` 1000, ``min_scale`` 1,
    ``delayed_shift`` 1, ``consecutive_hysteresis`` False), or the
    :class:`~modelparallel.parallel.precision.LossScaler` passed as ``loss_scaler``.
    ``step()`` unscales, skips a step whose gradients overflowed on any rank
    (``overflow`` says so) and adapts the scale; the scaler's state is part of
    ``state_dict()``. ``clip_master_grads(max_norm)`` clips the unscaled gradients to
    the whole model's norm (any precision). With ``sharded_data_parallel_degree`` > 1
    ``step()`` first clips the gradients to the global norm ``sdp_gradient_clipping``
    (0 disables), as SMP v1's sharded data parallelism does. With
    ``shard_optimizer_state`` each data-parallel replica keeps the state of its share of
    the parameters (:mod:`~modelparallel.parallel.optimizer_sharding`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, static_loss_scale: float | None = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: dict | None = None, *,
                 loss_scaler: LossScaler | None = None, **more_dynamic_loss_args: Any):
        s = state.require("mp.DistributedOptimizer").context
        super().__init__(optimizer)
        self._filtered = False
        self._sharding: OptimizerStateSharding | None = None
        self._unscaled = False  # clip_master_grads unscaled this step's gradients
        self._pending_load: Any = None  # load_state_dict before the split
        self.loss_scaler = wrapped_optimizer.loss_scaler_for(
            s.precision, static_loss_scale, dynamic_loss_scale,
            {**(dynamic_loss_args or {}), **more_dynamic_loss_args}, loss_scaler, s.rank)
        registry.set_optimizer(self)

    @property
    def overflow(self) -> bool:
        """Whether the last step's gradients overflowed (and the step was skipped)."""
        return self.loss_scaler is not None and self.loss_scaler.overflow

    def _prepare(self) -> None:
        self._filter()

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
        self._sharding = wrapped_optimizer.state_sharding(model, self._params())
        if self._pending_load is not None:
            pending, self._pending_load = self._pending_load, None
            self.load_state_dict(pending)

    def held_parameters(self) -> list[torch.Tensor]:
        """Every parameter this rank holds and steps (with ``shard_optimizer_state``,
        also those whose optimizer state another replica keeps)."""
        self._filter()
        return self._params()

    def _unscale(self) -> bool:
        """Unscale this step's gradients once (fp16); whether any rank overflowed."""
        if self.loss_scaler is None:
            return False
        if not self._unscaled:
            self.loss_scaler.unscale_(self.optimizer)
            self._unscaled = True
        return self.loss_scaler.overflow

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> Any:
        """Clip the (unscaled) gradients to the whole model's norm ``max_norm``; returns
        the norm before clipping, or -1 when the gradients overflowed (the step will be
        skipped), as SMP v1's ``FP16_Optimizer``. Call it before ``step()``."""
        self._filter()
        if self._unscale():
            return -1
        model = registry.model()
        return clip_grad_norm_(model if model is not None else self._params(), max_norm,
                               norm_type)

    # -- the calls of SMP v1's FP16_Optimizer (Apex's, modified) that fp16 scripts make.
    # Parameters stay float32 here (fp16 computes in half precision with float32
    # parameters), so there are no separate master weights: ``backward`` scales the loss
    # through the model, and the master-weight calls have nothing to do.
    def backward(self, loss: torch.Tensor, update_master_grads: bool = True,
                 retain_graph: bool = False) -> None:
        """``FP16_Optimizer.backward(loss)``: the microbatch's backward, with the loss
        scaled (inside an ``@smp.step`` function, like ``model.backward``)."""
        if retain_graph:
            raise ValueError("optimizer.backward(retain_graph=True) is not supported: "
                             "the pipeline frees each microbatch's graph after backward")
        model = registry.model()
        if model is None:
            raise RuntimeError("optimizer.backward(loss) needs mp.DistributedModel: create it "
                               "before the optimizer and call backward in an @mp.step "
                               "function")
        model.backward(loss)

    def update_master_grads(self) -> None:
        """Nothing to do: the float32 parameters already hold the gradients (the loss
        scale is removed at ``step()``/``clip_master_grads``)."""

    def init_master_params(self) -> None:
        """Nothing to do: there are no separate master weights."""

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> Any:
        """Apex's name for :meth:`clip_master_grads`."""
        return self.clip_master_grads(max_norm, norm_type)

    def step(self, *args, **kwargs):
        self._filter()
        c = state.require("mp.DistributedOptimizer.step").context.config
        overflow = self._unscale()
        self._unscaled = False
        if overflow:
            self.loss_scaler.update()  # skipped: the gradients overflowed somewhere
            return None
        model = registry.model()
        target = model if model is not None else self._params()
        if c.sharded_data_parallel_degree > 1 and c.sdp_gradient_clipping > 0:
            clip_grad_norm_(target, c.sdp_gradient_clipping)
        uses_norm = hasattr(self.optimizer, "grad_norm_fn") and model is not None
        if uses_norm:  # FusedLAMB: the whole model's norm (stages, shards, all replicas' parts)
            norm = clip_grad_norm_(target, float("inf"))
            self.optimizer.grad_norm_fn = lambda: norm
        try:
            if self._sharding is not None:
                result = self._sharding.step(self.optimizer, *args, **kwargs)
            else:
                result = self.optimizer.step(*args, **kwargs)
        finally:
            if uses_norm:
                self.optimizer.grad_norm_fn = None
        if self.loss_scaler is not None:
            self.loss_scaler.update()
        return result

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True,
                  set_grads_to_None: bool | None = None) -> None:
        """Clear the gradients (``set_grads_to_None`` is SMP v1's FP16_Optimizer name
        for ``set_to_none``)."""
        self._filter()
        if set_grads_to_None is not None:
            set_to_none = set_grads_to_None
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def local_state_dict(self, gather_if_shard: bool = False) -> dict[str, Any]:
        """This rank's optimizer state (with ``shard_optimizer_state``: its share, or
        with ``gather_if_shard`` its replicas' whole state: collective over them)."""
        self._filter()
        sharding = self._sharding if gather_if_shard else None
        if sharding is not None:
            sharding.gather_state(self.optimizer)
        sd = self.optimizer.state_dict()
        if sharding is not None:
            sharding.drop_others(self.optimizer)
        if self.loss_scaler is not None:
            sd["loss_scaler"] = self.loss_scaler.state_dict()
        return sd

    def state_dict(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """Every pipeline stage's optimizer state (SMP gathers them), stage order; with
        ``shard_optimizer_state`` each stage's whole state (gathered over its replicas).
        Collective over the pipeline (and the replicas)."""
        s = state.require("mp.DistributedOptimizer").context
        self._filter()
        if self._sharding is not None:
            self._sharding.gather_state(self.optimizer)
        local = self.local_state_dict()
        if self._sharding is not None:
            self._sharding.drop_others(self.optimizer)
        if s.topology.pp == 1:
            return [local]
        parts: list[Any] = [None] * s.topology.pp
        dist.all_gather_object(parts, local, group=s.process_group(CommGroup.PP_GROUP))
        return parts

    def load_state_dict(self, state_dict) -> None:
        """Load what ``state_dict()`` (every stage) or ``local_state_dict()`` (this rank)
        returned. Before the model is split it loads right after the split (as SMP)."""
        model = registry.model()
        if model is not None and not model.partitioned:
            if self._pending_load is None:
                model.register_post_partition_hook(lambda m, o: self._filter())
            self._pending_load = state_dict
            return
        self._filter()
        if isinstance(state_dict, list):
            s = state.require("mp.DistributedOptimizer").context
            state_dict = state_dict[s.topology.coordinate(s.rank)["pp"]]
        state_dict = dict(state_dict)
        scaler = state_dict.pop("loss_scaler", None)
        if scaler is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(scaler)
        self.optimizer.load_state_dict(state_dict)
        if self._sharding is not None:
            self._sharding.drop_others(self.optimizer)

    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer, over exactly the parameters this rank holds (what
        checkpoints save: ``checkpoint.protocol.WrappedOptimizer``). With
        ``shard_optimizer_state`` it holds the whole state until the next step (the
        replicas gather it: collective, as checkpoints are)."""
        self._filter()
        if self._sharding is not None:
            self._sharding.gather_state(self.optimizer)
        return self.optimizer
