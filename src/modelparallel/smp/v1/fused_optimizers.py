"""SMP v1's ``smp.optimizers``: ``FusedAdam``, ``FusedLAMB`` (``FusedLamb``) and
``FusedNovoGrad``, the Apex optimizers SMP wrapped, in plain PyTorch.

They take Apex's arguments and compute Apex's update (its CUDA kernels
``multi_tensor_adam``, ``multi_tensor_lamb`` and ``multi_tensor_novograd``, per
element in float32), on any device and on DTensor parameters (norms are over the whole
tensor). Two differences, neither changing the numbers: the step count lives in each
parameter's state (``state[p]["step"]``, as torch keeps it, so checkpoints reshard it)
rather than in the parameter group, and LAMB does not overwrite the gradients with
its update as Apex's kernel does.

``FusedLAMB`` clips by the global gradient norm (``max_grad_norm``). Under
``mp.DistributedOptimizer`` that norm is the whole model's, over pipeline stages and
shards (SMP gathers it over the pipeline); ``grad_norm_fn`` may supply it otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from modelparallel.notices import notice

Params = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


def _full(t: torch.Tensor) -> torch.Tensor:
    """A reduction's value over the whole tensor (a DTensor's over its mesh)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _norm(t: torch.Tensor, ord: float = 2.0) -> torch.Tensor:
    """The norm in float32 at least (Apex computes in float32)."""
    wide = t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
    return _full(torch.linalg.vector_norm(wide, ord))


class _SetGradNone(torch.optim.Optimizer):
    """Apex's ``set_grad_none``: what ``zero_grad()`` does when not told."""

    set_grad_none: bool

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)


class FusedAdam(_SetGradNone, torch.optim.Adam):
    """Apex's ``FusedAdam``: torch's Adam, with ``adam_w_mode=True`` (the default)
    decoupling the weight decay (AdamW) and ``False`` adding it to the gradient (L2).

    ``bias_correction=False`` is refused (torch's Adam always corrects);
    ``capturable`` and ``master_weights`` (CUDA graphs; float32 copies of half
    parameters) have no effect here: parameters stay float32 under modelparallel's
    precision policy, so they are the master weights.
    """

    def __init__(self, params: Params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True, capturable: bool = False,
                 master_weights: bool = False):
        if not bias_correction:
            raise ValueError("FusedAdam(bias_correction=False) is not supported: it is torch's "
                             "Adam, which always corrects the moments' bias; use "
                             "bias_correction=True, or FusedLAMB(bias_correction=False, "
                             "weight_decay=0.0, max_grad_norm=float('inf'))")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, decoupled_weight_decay=adam_w_mode)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none
        if master_weights and any(p.dtype != torch.float32 for g in self.param_groups
                                  for p in g["params"]):
            raise ValueError("FusedAdam(master_weights=True) keeps float32 copies of half "
                             "parameters, which is not built: keep the parameters float32 "
                             "(the bf16/fp16 configuration computes in half precision on "
                             "float32 parameters)")
        for name, value in (("capturable", capturable), ("master_weights", master_weights)):
            if value:
                notice("FusedAdam(%s=True) has no effect: %s", name,
                       "no CUDA graphs are captured here" if name == "capturable"
                       else "the parameters are float32 already, so they are the master weights")


class FusedLAMB(_SetGradNone):
    """LAMB (You et al., "Large Batch Optimization for Deep Learning"), as Apex's
    ``FusedLAMB`` computes it.

    Each step: the gradients are divided by ``global_norm / max_grad_norm`` when the
    global norm exceeds ``max_grad_norm``; Adam moments (``grad_averaging``: the first
    moment takes ``1 - beta1`` of the gradient, else all of it), bias-corrected if
    ``bias_correction``; the update is ``m / (sqrt(v) + eps)`` plus ``weight_decay * p``
    (``adam_w_mode``; otherwise the decay is added to the gradient first, L2); each
    tensor then moves by ``lr * |p| / |update|`` times its update when it has weight
    decay or ``use_nvlamb`` (and both norms are non-zero), else by ``lr``.
    """

    def __init__(self, params: Params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, amsgrad: bool = False, adam_w_mode: bool = True,
                 grad_averaging: bool = True, set_grad_none: bool = True,
                 max_grad_norm: float = 1.0, use_nvlamb: bool = False):
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none
        self.use_nvlamb = use_nvlamb
        # the global gradient norm; None: over this optimizer's gradients
        self.grad_norm_fn: Callable[[], torch.Tensor] | None = None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return loss
        if self.grad_norm_fn is not None:
            global_norm = self.grad_norm_fn().float()
        else:
            global_norm = torch.linalg.vector_norm(torch.stack([_norm(g) for g in grads]))
        max_norm = self.defaults["max_grad_norm"]  # Apex reads the default, not the group's
        # python numbers from here: DTensor arithmetic takes them with any placement
        norm = float(global_norm)
        clip = norm / max_norm if norm > max_norm else 1.0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
            decay, eps, lr = group["weight_decay"], group["eps"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedLAMB does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                step = float(state["step"])
                bc1 = 1 - beta1 ** step if group["bias_correction"] else 1.0
                bc2 = 1 - beta2 ** step if group["bias_correction"] else 1.0
                m, v = state["exp_avg"], state["exp_avg_sq"]
                g = p.grad / clip
                if not self.adam_w_mode and decay != 0:
                    g = g + decay * p
                m.mul_(beta1).add_(g, alpha=beta3)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / bc1) / ((v / bc2).sqrt() + eps)
                if self.adam_w_mode and decay != 0:
                    update = update + decay * p
                if self.use_nvlamb or decay != 0:
                    p_norm, u_norm = float(_norm(p)), float(_norm(update))
                    ratio = lr * p_norm / u_norm if p_norm != 0 and u_norm != 0 else lr
                else:
                    ratio = lr
                p.sub_(update, alpha=ratio)
        return loss


FusedLamb = FusedLAMB


class FusedNovoGrad(_SetGradNone):
    """NovoGrad (Ginsburg et al., Jasper), as Apex's ``FusedNovoGrad`` computes it.

    The second moment is one number per tensor: the norm of its gradient (``norm_type``
    2, or 0 for the largest magnitude), blended as ``sqrt(beta2 v^2 + (1-beta2) n^2)``
    (``beta2 v + (1-beta2) n`` for 0) and started at the first step's norm (0 with
    ``init_zero``). ``reg_inside_moment``: the normalized gradient plus
    ``weight_decay * p`` enters the first moment; otherwise the raw gradient does and
    the decay is added to the update.
    """

    def __init__(self, params: Params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False,
                 reg_inside_moment: bool = False, grad_averaging: bool = True,
                 norm_type: int = 2, init_zero: bool = False, set_grad_none: bool = True):
        if amsgrad:
            raise RuntimeError("FusedNovoGrad does not support the AMSGrad variant.")
        if norm_type not in (0, 2):
            raise RuntimeError("FusedNovoGrad only support l2/inf norm now.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        norm_type=norm_type, init_zero=init_zero)
        super().__init__(params, defaults)
        self.moment_mode = 0 if reg_inside_moment else 1
        self.set_grad_none = set_grad_none

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
            decay, eps, lr = group["weight_decay"], group["eps"], group["lr"]
            inf_norm = group["norm_type"] == 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedNovoGrad does not support sparse gradients")
                g = p.grad
                n = _norm(g, math.inf if inf_norm else 2.0)
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(n) if group["init_zero"] \
                        else n.clone()  # the first blend then has no effect
                state["step"] += 1
                step = float(state["step"])
                bc1 = 1 - beta1 ** step if group["bias_correction"] else 1.0
                bc2 = math.sqrt(1 - beta2 ** step) if group["bias_correction"] else 1.0
                v = state["exp_avg_sq"]
                if inf_norm:
                    v.mul_(beta2).add_(n, alpha=1 - beta2)
                else:
                    v.copy_((beta2 * v * v + (1 - beta2) * n * n).sqrt())
                denom = float(v) / bc2 + eps
                m = state["exp_avg"]
                if self.moment_mode == 0:
                    m.mul_(beta1).add_(g / denom + decay * p, alpha=beta3)
                    p.sub_(m / bc1, alpha=lr)
                else:
                    m.mul_(beta1).add_(g, alpha=beta3)
                    p.sub_((m / bc1) / denom + decay * p, alpha=lr)
        return loss


__all__ = ["FusedAdam", "FusedLAMB", "FusedLamb", "FusedNovoGrad"]
