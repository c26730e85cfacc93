"""Mixed precision (``bf16`` / ``fp16``): one policy, one translation per wrapper.

:class:`~modelparallel.precision_policy.PrecisionPolicy` (``ctx.precision``) is decided
once per ``mp.init()``. Here it becomes what each wrapper takes: FSDP2's
``MixedPrecisionPolicy`` (:func:`fsdp2_policy`), FSDP1's ``MixedPrecision``
(:func:`fsdp1_policy`), and for every other path (``mp.replicate``, ``transform``
alone, ``DistributedModel`` without sharding) parameter views that cast each module's
parameters as its forward reads them (:func:`compute_as`).

``fp16`` needs loss scaling: :class:`LossScaler` (``DistributedOptimizer`` uses one by
itself). A float16 model whose optimizer steps on gradients no scaler unscaled is an
error (:func:`require_loss_scaling`), not a silent underflow.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from modelparallel.errors import ConfigError
from modelparallel.module_state import lookup, state_of
from modelparallel.parallel.param_views import add_view
from modelparallel.precision_policy import PrecisionPolicy


def fsdp2_policy(policy: PrecisionPolicy) -> MixedPrecisionPolicy:
    """FSDP2's form of ``policy`` (FSDP2 leaves buffers as they are)."""
    return MixedPrecisionPolicy(param_dtype=policy.param_dtype,
                                reduce_dtype=policy.reduce_dtype)


def fsdp1_policy(policy: PrecisionPolicy, given: MixedPrecision | None,
                 key: str) -> MixedPrecision | None:
    """FSDP1's form of ``policy``; a script's own ``given`` stands when it computes in the
    same type (``key``: the configuration key that chose the policy, for the error)."""
    if not policy.mixed:
        return given
    if given is None:
        return MixedPrecision(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,
                              buffer_dtype=policy.buffer_dtype)
    if given.param_dtype != policy.param_dtype:
        raise ConfigError([(key, f"{key}=True computes in {policy.param_dtype}, but the "
                                 f"script's FSDP MixedPrecision has param_dtype="
                                 f"{given.param_dtype}; make them agree, or drop {key}")])
    return given


def compute_as(model: nn.Module, policy: PrecisionPolicy, blocks: list[nn.Module]) -> None:
    """``policy`` for a model no FSDP wrapper casts: compute in its ``param_dtype`` with
    float32 parameters (:func:`compute_in`), and require loss scaling where it says so."""
    if policy.param_dtype is not None:
        compute_in(model, policy.param_dtype, blocks)
    if policy.loss_scaling:
        require_loss_scaling(model)


def compute_dtype(model: nn.Module) -> torch.dtype | None:
    """The half type :func:`compute_in` gave ``model``, if any."""
    return lookup(model, "compute_dtype")


def compute_in(model: nn.Module, dtype: torch.dtype, blocks: list[nn.Module]) -> None:
    """Compute ``model``'s forward and backward in ``dtype`` with float32 parameters.

    Every floating parameter is cast as its module's forward reads it (the cast is
    differentiable: the gradient comes back to the float32 parameter in float32), and
    floating inputs of the model and of each of ``blocks`` are cast as FSDP casts the
    inputs of its units. Idempotent.
    """
    if compute_dtype(model) is not None:
        return
    state_of(model).compute_dtype = dtype

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    for module in model.modules():
        names = [n for n, p in module.named_parameters(recurse=False) if p.is_floating_point()]
        if names:
            add_view(module, cast, names)

    def cast_inputs(module, args, kwargs):
        return pytree.tree_map(
            lambda t: cast(t) if isinstance(t, torch.Tensor) else t, (args, kwargs))

    for unit in [model, *blocks]:
        unit.register_forward_pre_hook(cast_inputs, with_kwargs=True, prepend=True)


# -- loss scaling ------------------------------------------------------------------------

class LossScaler:
    """Dynamic (or static) loss scaling for float16 training, agreed on by every rank.

    ``scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()``.
    ``step`` unscales the gradients (float32 masters, any sharding) and skips the
    optimizer step when any rank found an inf or NaN in its part (one all-reduce over
    ``group``, default every rank). ``update`` adapts the scale as SMP v1's
    ``dynamic_loss_args`` describe (Apex's dynamic scaler): on overflow divide by
    ``scale_factor`` (not below ``min_scale``) after ``delayed_shift`` overflows; after
    ``scale_window`` steps without one, multiply by ``scale_factor``. ``dynamic=False``
    keeps ``init_scale`` and still skips overflowing steps. ``state_dict()`` holds it all.
    """

    def __init__(self, init_scale: float = 2.0 ** 32, scale_factor: float = 2.0,
                 scale_window: int = 1000, min_scale: float = 1.0, delayed_shift: int = 1,
                 consecutive_hysteresis: bool = False, *, dynamic: bool = True,
                 group: dist.ProcessGroup | None = None):
        if not (init_scale > 0 and math.isfinite(init_scale)):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale}")
        self.scale_value = float(init_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.dynamic = dynamic
        self.group = group
        self.iteration = 0
        self.last_overflow_iteration = -1
        self.hysteresis = self.delayed_shift
        self.overflow = False  # the last step's gradients held an inf or NaN
        self._unscaled: set[int] = set()  # ids of optimizers unscaled since their last step

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` (in float32) times the current scale."""
        return loss.float() * self.scale_value

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide the gradients of ``optimizer``'s parameters by the scale; returns whether
        any rank found an inf or NaN (then the gradients are left as they are)."""
        grads = [_local(p.grad) for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        bad = torch.zeros((), dtype=torch.float32)
        for g in grads:
            bad += (~torch.isfinite(g)).sum().cpu().float()
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            device = grads[0].device if grads and grads[0].device.type == "cuda" else "cpu"
            bad = bad.to(device)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        self.overflow = bool(bad.item() > 0)
        if not self.overflow:
            inverse = 1.0 / self.scale_value
            for g in grads:
                g.mul_(inverse)
        self._unscaled.add(id(optimizer))
        _UNSCALED.add(optimizer)  # read by _check_scaled
        return self.overflow

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` ran) and step, or skip the step on overflow."""
        if id(optimizer) not in self._unscaled:
            self.unscale_(optimizer)
        self._unscaled.discard(id(optimizer))
        if self.overflow:
            _UNSCALED.discard(optimizer)
            return None
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """Adapt the scale to the last step's overflow (dynamic scaling only)."""
        if self.dynamic:
            if self.overflow:
                if self.delayed_shift == 1 or self.hysteresis == 1:
                    self.scale_value = max(self.scale_value / self.scale_factor, self.min_scale)
                else:
                    self.hysteresis -= 1
                self.last_overflow_iteration = self.iteration
            else:
                if self.consecutive_hysteresis:
                    self.hysteresis = self.delayed_shift
                if (self.iteration - self.last_overflow_iteration) % self.scale_window == 0:
                    if not self.consecutive_hysteresis:
                        self.hysteresis = self.delayed_shift
                    self.scale_value *= self.scale_factor
        self.iteration += 1

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale_value, "iteration": self.iteration,
                "last_overflow_iteration": self.last_overflow_iteration,
                "hysteresis": self.hysteresis, "overflow": self.overflow,
                "dynamic": self.dynamic, "scale_factor": self.scale_factor,
                "scale_window": self.scale_window, "min_scale": self.min_scale,
                "delayed_shift": self.delayed_shift,
                "consecutive_hysteresis": self.consecutive_hysteresis}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale_value = float(state["scale"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
        self.hysteresis = int(state["hysteresis"])
        self.overflow = bool(state["overflow"])
        self.dynamic = bool(state["dynamic"])
        self.scale_factor = float(state["scale_factor"])
        self.scale_window = int(state["scale_window"])
        self.min_scale = float(state["min_scale"])
        self.delayed_shift = int(state["delayed_shift"])
        self.consecutive_hysteresis = bool(state["consecutive_hysteresis"])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# -- float16 without a loss scaler is an error ----------------------------------------------

# parameters of float16 models (weak: they leave with their model), and optimizers a
# LossScaler unscaled since their last step
_NEEDS_SCALING: WeakIdKeyDictionary = WeakIdKeyDictionary()
_UNSCALED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_hook_installed = False


def require_loss_scaling(model: nn.Module) -> None:
    """Make an optimizer step over ``model``'s parameters that no :class:`LossScaler`
    prepared raise, naming the fix (float16 gradients underflow without scaling). Call
    it on the final (wrapped) model: the mark is on its parameter objects."""
    global _hook_installed
    for p in model.parameters():
        _NEEDS_SCALING[p] = True
    if not _hook_installed:
        register_optimizer_step_pre_hook(_check_scaled)
        _hook_installed = True


def _check_scaled(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if optimizer in _UNSCALED:
        _UNSCALED.discard(optimizer)
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not any(p in _NEEDS_SCALING for p in params):
        return
    # torch's own state initialisation (distributed checkpoint loading) steps once on zero
    # gradients: nothing can have underflowed there
    if any(p.grad is not None and bool(_local(p.grad).any()) for p in params):
        raise RuntimeError(
            "fp16=True: the model computes in float16, whose gradients underflow without loss "
            "scaling, and optimizer.step() ran on gradients no loss scaler unscaled. Use "
            "scaler = mp.LossScaler(); scaler.scale(loss).backward(); scaler.step(optimizer); "
            "scaler.update() (mp.DistributedModel with mp.DistributedOptimizer does this "
            "itself), or train in bf16.")
