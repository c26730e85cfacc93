"""Where activation offloading is applied: SMP v1's marked layers under the root a
``DistributedModel`` runs, and SMP v2's ``offload_wrapper`` (``parallel/offload.py`` is
the mechanism).

- :func:`offload_checkpointed` (SMP v1 ``offload_activations``; ``parallelize`` applies
  it after activation checkpointing): the inputs of the checkpointed modules are
  offloaded, each call of the root is a forward pass.
- :func:`route_offload_wrapper` (SMP v2 ``sm_activation_offloading``): torch's
  ``offload_wrapper`` runs an offloader over its whole forward, with the checkpointed
  layers under it prefetched within the horizon; or torch's own ``save_on_cpu`` when
  the settings say so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from modelparallel.module_state import own_state, state_of
from modelparallel.parallel.offload import ActivationOffloader, checkpointed_layers, normalise
from modelparallel.parallel.offload_torch import (
    TORCH_OFFLOAD_FORWARD,
    set_offload_wrapper_forward,
    wrapped_module,
)

logger = logging.getLogger("modelparallel")

def offloader_of(module: nn.Module) -> ActivationOffloader | None:
    """The offloader applied to ``module`` (a root or an offload_wrapper), if any."""
    return state.activation_offloader if (state := own_state(module)) else None


def offload_checkpointed(model: nn.Module, device: torch.device | str,
                         horizon: int) -> ActivationOffloader | None:
    """SMP v1's ``offload_activations``: offload the inputs of ``model``'s checkpointed
    modules (apply after ``apply_activation_checkpointing``); each call of ``model`` is a
    pass. With nothing checkpointed there is nothing to offload: one line says so."""
    existing = offloader_of(model)
    if existing is not None:
        return existing
    layers = checkpointed_layers(model)
    if not layers:
        logger.warning("offload_activations=True has no effect: no module this rank holds "
                       "is checkpointed (SMP offloads only checkpointed activations; mark "
                       "layers with smp.set_activation_checkpointing)")
        return None
    offloader = ActivationOffloader(device, horizon)
    offloader.attach(model, layers)
    state_of(model).activation_offloader = offloader
    return offloader


Settings = Callable[[], "tuple[torch.device, int] | None"]


def route_offload_wrapper(settings: Settings | None) -> None:
    """SMP v2: torch's ``offload_wrapper`` runs this module's offloader whenever
    ``settings()`` gives ``(device, horizon)``, and torch's own ``save_on_cpu`` when it
    gives None (``sm_activation_offloading`` off, or no ``mp.init()``). ``settings=None``
    gives torch's forward back for good."""
    if settings is None:
        set_offload_wrapper_forward(None)
        return

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        chosen = settings()
        if chosen is None:
            return TORCH_OFFLOAD_FORWARD(self, *args, **kwargs)
        with _wrapper_offloader(self, *chosen).forward_pass():
            return wrapped_module(self)(*args, **kwargs)

    set_offload_wrapper_forward(forward)


def _wrapper_offloader(wrapper: nn.Module, device: torch.device,
                       horizon: int) -> ActivationOffloader:
    """The offloader of one offload_wrapper, made at its first forward (checkpointing is
    applied by then) and again if the settings changed."""
    offloader = offloader_of(wrapper)
    if offloader is not None and (offloader.device, offloader.horizon) == (
            normalise(device), horizon):
        return offloader
    if offloader is not None:
        offloader.detach()
    offloader = ActivationOffloader(device, horizon, offload_outside_layers=True)
    layers = checkpointed_layers(wrapped_module(wrapper))
    if not layers:
        logger.warning("sm_activation_offloading: no checkpointed layer under offload_wrapper, "
                       "so nothing is prefetched: what its forward saves goes to CPU and comes "
                       "back when backward needs it (apply activation checkpointing first)")
    offloader.attach(None, layers)
    state_of(wrapper).activation_offloader = offloader
    return offloader
