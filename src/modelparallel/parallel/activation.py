"""Activation checkpointing: marked modules recompute their activations in backward."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from modelparallel.module_state import lookup, own_state, state_of
from modelparallel.parallel.deferred import recipe_of
from modelparallel.parallel.placement import is_meta


def set_activation_checkpointing(module: nn.Module, preserve_rng_state: bool = True,
                                 pack_args_as_tuple: bool = False,
                                 strategy: str = "each") -> None:
    """Recompute ``module``'s activations in backward instead of keeping them (SMP v1).

    Call before the first step of ``mp.DistributedModel``. An ``nn.Sequential`` /
    ``nn.ModuleList`` has each child checkpointed (``strategy="each"``, the only
    strategy here). Module names stay as they are. ``pack_args_as_tuple`` is accepted
    for SMP v1 scripts; it is not needed here.
    """
    del pack_args_as_tuple
    if strategy != "each":
        raise ValueError(f"strategy={strategy!r} is not supported; use 'each' (every child of "
                         "a Sequential/ModuleList recomputed on its own), or mark the modules "
                         "to group yourself")
    state_of(module).activation_checkpointing = preserve_rng_state


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Checkpoint the marked modules of ``model`` that this rank holds: each one's
    forward runs inside ``torch.utils.checkpoint.checkpoint`` (non-reentrant), which may
    recompute it more than once (the zero-bubble schedules run a backward for the
    inputs and another for the weights; torch's composable ``checkpoint`` recomputes
    only once). Apply before FSDP, so recomputation runs inside FSDP's gathered
    parameters."""
    containers = (nn.Sequential, nn.ModuleList)
    for module in list(model.modules()):
        preserve_rng = lookup(module, "activation_checkpointing")
        if preserve_rng is None:
            continue
        for target in module.children() if isinstance(module, containers) else [module]:
            # meta parameters are another stage's, unless recorded for delayed
            # initialization (allocated later, when FSDP shards this rank's units)
            if not any(is_meta(p) and recipe_of(p) is None for p in target.parameters()):
                _recompute_in_backward(target, preserve_rng)


def is_recomputed(module: nn.Module) -> bool:
    """Whether ``apply_activation_checkpointing`` checkpointed ``module``."""
    return bool((state := own_state(module)) and state.recomputed)


def _recompute_in_backward(module: nn.Module, preserve_rng_state: bool) -> None:
    if is_recomputed(module):
        return
    original = module.forward  # the bound method; hooks still run around the call

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        return torch_checkpoint(original, *args, use_reentrant=False,
                                preserve_rng_state=preserve_rng_state, **kwargs)

    object.__setattr__(module, "forward", forward)
    state_of(module).recomputed = True
