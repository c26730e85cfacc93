"""What makes ``mp.DistributedOptimizer`` a ``torch.optim.Optimizer``, and SMP v1's
loss-scaling arguments.

torch's learning-rate schedulers (and much else) accept only instances of
``torch.optim.Optimizer``. :class:`WrappedTorchOptimizer` is one whose parameter
groups, state and defaults are the wrapped optimizer's own objects, so a scheduler
given the wrapper or ``wrapper.optimizer`` changes the same learning rates; hooks
registered on the wrapper go to the wrapped optimizer, whose ``step()`` runs them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from modelparallel.parallel.optimizer_sharding import OptimizerStateSharding
from modelparallel.parallel.precision import LossScaler
from modelparallel.precision_policy import PrecisionPolicy

logger = logging.getLogger("modelparallel")

DYNAMIC_LOSS_ARGS = ("init_scale", "scale_factor", "scale_window", "min_scale",
                     "delayed_shift", "consecutive_hysteresis")


class WrappedTorchOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that is a view of ``optimizer`` (``self.optimizer``).

    torch's ``Optimizer.__init__`` is not run: it would make groups and state of the
    wrapper's own. Subclasses override :meth:`_prepare` (called before the groups are
    read) and ``step``.
    """

    # GradScaler must unscale for us rather than hand a fused inner optimizer its scale
    _step_supports_amp_scaling = False

    def __init__(self, optimizer: torch.optim.Optimizer):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer to wrap, got "
                            f"{type(optimizer).__name__}")
        self.optimizer = optimizer

    def _prepare(self) -> None:
        """Bring the wrapped optimizer's groups up to date (subclasses)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        self._prepare()
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    # hooks belong to the optimizer whose step() and state_dict() run them
    def register_step_pre_hook(self, hook: Callable) -> RemovableHandle:
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable) -> RemovableHandle:
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook: Callable,
                                     prepend: bool = False) -> RemovableHandle:
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook: Callable,
                                      prepend: bool = False) -> RemovableHandle:
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook: Callable,
                                          prepend: bool = False) -> RemovableHandle:
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook: Callable,
                                           prepend: bool = False) -> RemovableHandle:
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __getattr__(self, name: str) -> Any:
        # what the wrapped optimizer has and the wrapper does not (Apex's attributes ...)
        inner = self.__dict__.get("optimizer")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


def loss_scaler_for(precision: PrecisionPolicy, static_loss_scale: float | None,
                    dynamic_loss_scale: bool, dynamic_loss_args: dict[str, Any],
                    loss_scaler: LossScaler | None, rank: int) -> LossScaler | None:
    """The loss scaler SMP v1's ``FP16_Optimizer`` would use for these arguments (None
    unless the precision policy scales the loss: fp16)."""
    fp16 = precision.loss_scaling
    given = static_loss_scale != 1.0 or dynamic_loss_scale or bool(dynamic_loss_args)
    if loss_scaler is not None:
        if not fp16:
            raise ValueError("a loss_scaler is for fp16=True; the configuration trains in "
                             f"{precision.name}, which needs none")
        if given:
            raise ValueError("pass either loss_scaler= or static_loss_scale / "
                             "dynamic_loss_scale / dynamic_loss_args, not both")
        return loss_scaler
    if not fp16:
        if given and rank == 0:
            logger.warning("DistributedOptimizer(static_loss_scale / dynamic_loss_scale / "
                           "dynamic_loss_args) have no effect: the configuration trains in "
                           "%s, and loss scaling is only for fp16: True (as in SMP v1)",
                           precision.name)
        return None
    unknown = sorted(set(dynamic_loss_args) - set(DYNAMIC_LOSS_ARGS))
    if unknown:
        raise TypeError(f"unknown dynamic_loss_args {unknown}; SMP v1's are "
                        f"{', '.join(DYNAMIC_LOSS_ARGS)}")
    if dynamic_loss_scale:
        return LossScaler(**dynamic_loss_args)
    if dynamic_loss_args and rank == 0:
        logger.warning("dynamic_loss_args have no effect without dynamic_loss_scale=True: "
                       "the loss scale stays static_loss_scale=%s", static_loss_scale)
    if static_loss_scale is None:
        raise ValueError("static_loss_scale=None needs dynamic_loss_scale=True (SMP's "
                         "recommended form: static_loss_scale=None, dynamic_loss_scale=True)")
    return LossScaler(static_loss_scale, dynamic=False)


def state_sharding(model: Any, params: list[torch.Tensor]) -> OptimizerStateSharding | None:
    """``shard_optimizer_state``: the sharding of ``params``' optimizer state over the
    data-parallel replicas of a partitioned ``DistributedModel`` (None when off, or when
    there is nothing to shard; said once)."""
    ctx = model.engine.ctx
    if not ctx.config.shard_optimizer_state:
        return None
    fsdp = model.engine.gradients.fsdp  # FSDP keeps their state sharded already
    mine = [p for p in params if id(p) not in fsdp and p.requires_grad]
    group = ctx.gradient_group(model.engine.gradients.tp_replicas)
    size = dist.get_world_size(group)
    if size == 1 or len(mine) < size:
        if ctx.rank == 0:
            why = ("there is one data-parallel replica" if size == 1 else
                   "FSDP shards the parameters, and with them their optimizer state" if fsdp
                   else f"{len(mine)} parameters cannot be spread over {size} replicas")
            logger.warning("shard_optimizer_state=True has no effect: %s", why)
        return None
    if fsdp and ctx.rank == 0:
        logger.warning("shard_optimizer_state=True: the %d parameters FSDP shards keep their "
                       "sharded state; the other %d are sharded over the replicas",
                       len(fsdp), len(mine))
    return OptimizerStateSharding(mine, group)
