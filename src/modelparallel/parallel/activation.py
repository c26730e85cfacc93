"""Activation checkpointing: marked modules recompute their activations in backward."""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint

from modelparallel.parallel.placement import is_meta

_ATTR = "_mp_activation_checkpointing"  # preserve_rng_state of a marked module


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
    object.__setattr__(module, _ATTR, preserve_rng_state)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Checkpoint the marked modules of ``model`` that this rank holds (torch's composable
    ``checkpoint``). Apply before FSDP, so recomputation runs inside FSDP's gathered
    parameters."""
    containers = (nn.Sequential, nn.ModuleList)
    for module in list(model.modules()):
        preserve_rng = getattr(module, _ATTR, None)
        if preserve_rng is None:
            continue
        for target in module.children() if isinstance(module, containers) else [module]:
            if not any(is_meta(p) for p in target.parameters()):
                checkpoint(target, preserve_rng_state=preserve_rng)
