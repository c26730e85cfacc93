"""``torch.sagemaker.distributed.checkpoint.state_dict_utils``: SMP's local state dicts,
optimizer-state initialisation before loading, and the automatic checkpoint interval."""

from __future__ import annotations

import contextlib
import enum
import math
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import OptimStateDictConfig, StateDictConfig, StateDictType
from torch.distributed.tensor import DTensor

from modelparallel.smp.v2.checkpoint._common import collective_device


class SMStateDictType(enum.Enum):
    """SMP's own state-dict type (next to FSDP's ``StateDictType``)."""

    SM_LOCAL_STATE_DICT = enum.auto()
    """What this rank holds, as plain tensors under the parameters' names: no
    collective, no metadata exchange. Loading needs the same sharding (shard degree and
    wrapping) as saving; the number of replicas may differ."""


class _LoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


# wrapper prefixes that are no part of a parameter's name
_WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _clean(name: str) -> str:
    for prefix in _WRAPPERS:
        name = name.replace(prefix, "")
    return name


def local_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``SM_LOCAL_STATE_DICT`` of ``module``: every parameter and buffer as the tensor
    this rank holds (an FSDP1 shard's view, an FSDP2/DTensor local shard, or the whole
    tensor), sharing its storage, so loading into it writes the model in place.

    Buffers are all included (non-persistent ones too): they are local and cheap."""
    out: dict[str, torch.Tensor] = {}
    named = [*module.named_parameters(), *module.named_buffers()]
    for name, tensor in named:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        out[_clean(name)] = local.detach()
    return out


def load_local_state_dict(module: nn.Module, state_dict: dict[str, Any]) -> None:
    """Copy an ``SM_LOCAL_STATE_DICT`` into ``module``'s tensors (same keys and shapes)."""
    own = local_state_dict(module)
    missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise KeyError(f"SM_LOCAL_STATE_DICT keys differ: missing {missing[:5]}, unexpected "
                       f"{unexpected[:5]}")
    with torch.no_grad():
        for name, tensor in own.items():
            value = state_dict[name]
            if tuple(value.shape) != tuple(tensor.shape):
                raise ValueError(f"SM_LOCAL_STATE_DICT {name}: shape {tuple(value.shape)} here "
                                 f"{tuple(tensor.shape)}: a local state dict loads only under "
                                 f"the same sharding it was saved with")
            tensor.copy_(value)


@contextlib.contextmanager
def sm_state_dict_type(module: nn.Module, state_dict_type: SMStateDictType | StateDictType,
                       state_dict_config: StateDictConfig | None = None,
                       optim_state_dict_config: OptimStateDictConfig | None = None
                       ) -> Iterator[None]:
    """Within the block, ``module.state_dict()`` / ``load_state_dict()`` use
    ``state_dict_type``.

    - ``SMStateDictType.SM_LOCAL_STATE_DICT``: :func:`local_state_dict` (any model:
      FSDP1, ``mp.shard``/FSDP2, plain). The torch optimizer's own ``state_dict()`` is
      already local to the rank for FSDP1; load it in place with DCP after
      :func:`init_optim_state`. Only the ``module`` passed (the root) is switched.
    - FSDP's ``StateDictType``: ``FSDP.state_dict_type(module, ...)`` with the configs
      (FSDP1 models only; an ``mp.shard``/FSDP2 model uses
      ``torch.distributed.checkpoint.state_dict`` instead).
    """
    if isinstance(state_dict_type, StateDictType):
        if not FSDP.fsdp_modules(module):
            raise TypeError(f"sm_state_dict_type(model, {state_dict_type}) applies to FSDP1 "
                            f"(FullyShardedDataParallel) models; {type(module).__name__} has no "
                            f"FSDP1 module. For an mp.shard / fully_shard model use "
                            f"torch.distributed.checkpoint.state_dict.get_model_state_dict")
        with FSDP.state_dict_type(module, state_dict_type, state_dict_config,
                                  optim_state_dict_config):
            yield
        return
    if state_dict_type is not SMStateDictType.SM_LOCAL_STATE_DICT:
        raise TypeError(f"sm_state_dict_type: unknown state_dict_type {state_dict_type!r}")
    if state_dict_config is not None or optim_state_dict_config is not None:
        raise TypeError("sm_state_dict_type: SM_LOCAL_STATE_DICT takes no state_dict_config "
                        "or optim_state_dict_config")
    saved = {k: module.__dict__[k] for k in ("state_dict", "load_state_dict")
             if k in module.__dict__}

    def state_dict(*args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        if args or kwargs:
            raise TypeError("state_dict() under SM_LOCAL_STATE_DICT takes no arguments")
        return local_state_dict(module)

    def load_state_dict(state: dict[str, Any], strict: bool = True, assign: bool = False) -> Any:
        if not strict or assign:
            raise TypeError("load_state_dict() under SM_LOCAL_STATE_DICT loads strictly, "
                            "in place (strict=True, assign=False)")
        load_local_state_dict(module, state)
        return _LoadResult([], [])

    # an instance attribute shadows the method for this module only, until the block ends
    object.__setattr__(module, "state_dict", state_dict)
    object.__setattr__(module, "load_state_dict", load_state_dict)
    try:
        yield
    finally:
        for name in ("state_dict", "load_state_dict"):
            if name in saved:
                object.__setattr__(module, name, saved[name])
            else:
                object.__delattr__(module, name)


def init_optim_state(optimizer: torch.optim.Optimizer, skip_empty_param: bool = True) -> None:
    """Give every parameter its optimizer state (as after one step), without changing
    any parameter, so that a state dict taken from the optimizer can be loaded into in
    place (DCP). Does nothing if the optimizer already has state.

    One step with zero gradients and learning rate 0; parameters that do not require
    grad, and with ``skip_empty_param`` those with no elements on this rank (an FSDP1
    rank without a piece of them), get no state, as in training. Existing gradients are
    kept.
    """
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]
              if p.requires_grad and not (skip_empty_param and p.numel() == 0)]
    grads = {id(p): p.grad for group in optimizer.param_groups for p in group["params"]}
    lrs = [group.get("lr") for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
            if "lr" in group:
                group["lr"] = torch.zeros_like(group["lr"]) \
                    if isinstance(group["lr"], torch.Tensor) else 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            if lr is not None:
                group["lr"] = lr
            for p in group["params"]:
                p.grad = grads[id(p)]


@dataclass
class _Interval:
    """An automatic checkpoint interval and the medians it was computed from (seconds);
    ``interval`` <= 0 until computed."""

    interval: int = -1
    step_duration: float = -1.0
    step_ckpt_duration: float = -1.0
    ckpt_preprocessing_duration: float = -1.0
    ckpt_io_duration: float = -1.0


def compute_auto_checkpoint_interval(step_durations: Sequence[float],
                                     step_ckpt_durations: Sequence[float],
                                     ckpt_preprocessing_durations: Sequence[float],
                                     ckpt_io_durations: Sequence[float]) -> _Interval:
    """How many steps apart asynchronous checkpoints should be so that a save never
    waits for the previous one: the background write takes ``ckpt_io`` seconds while
    training goes on, so ``interval = ceil(ckpt_io / step)`` (at least 1), from the
    medians of the measured durations (a step without and with a checkpoint, the
    foreground preparation, the background write).

    Collective when a process group exists: each median is the largest over the ranks,
    so every rank computes the same interval. (SMP's own formula is not published; this
    is modelparallel's.)
    """
    lists = (step_durations, step_ckpt_durations, ckpt_preprocessing_durations,
             ckpt_io_durations)
    if not all(lists):
        raise ValueError("compute_auto_checkpoint_interval needs at least one duration of "
                         "each kind")
    medians = torch.tensor([statistics.median(v) for v in lists], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        medians = medians.to(collective_device())
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    step, step_ckpt, prep, io = (float(v) for v in medians.cpu())
    interval = max(1, math.ceil(io / step)) if step > 0 else 1
    return _Interval(interval, step, step_ckpt, prep, io)


__all__ = ["SMStateDictType", "compute_auto_checkpoint_interval", "init_optim_state",
           "sm_state_dict_type"]
