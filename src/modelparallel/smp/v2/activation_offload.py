"""SMP v2's activation offloading: torch's ``offload_wrapper``, as scripts import it
(``from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import
offload_wrapper``), runs SMP's prefetching offloader while the current ``mp.init()``
has ``sm_activation_offloading`` on (SMP v2's default), with
``activation_loading_horizon`` (default 2 here, as in SMP v2). With it off, or before
``mp.init()``, the wrapper is torch's own. The work is done in
``modelparallel.parallel.offload`` / ``offload_roots``.

Importing this module installs the switch (:func:`install`, idempotent).
"""

from __future__ import annotations

import torch
from torch import nn

from modelparallel.parallel.offload import loading_horizon
from modelparallel.parallel.offload_roots import offloader_of, route_offload_wrapper
from modelparallel.parallel.offload_torch import OffloadWrapper
from modelparallel.smp.state import state

__all__ = ["install", "offload_wrapper", "offloader_of", "settings"]


def settings() -> tuple[torch.device, int] | None:
    """(device, horizon) for SMP's offloader under the current ``mp.init()``, or None for
    torch's own offload_wrapper (not initialised, or ``sm_activation_offloading`` off)."""
    ctx = state.context_or_none()
    if ctx is None or not ctx.config.sm_activation_offloading:
        return None
    return ctx.device, loading_horizon(ctx.config.activation_loading_horizon, v2=True)


def install() -> None:
    """Route every torch ``OffloadWrapper``'s forward through :func:`settings`."""
    route_offload_wrapper(settings)


def offload_wrapper(module: nn.Module) -> nn.Module:
    """torch's ``offload_wrapper(module)`` (apply it to the root, after activation
    checkpointing), with SMP's offloader when ``sm_activation_offloading`` is on."""
    install()
    return OffloadWrapper(module)


install()
