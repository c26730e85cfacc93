"""torch's own ``torch.nn.utils.clip_grad_norm_`` on parameters whose gradients it
cannot add up: after ``mp.init()`` it returns the global norm of any layout.

torch's function stacks the per-parameter norms into one tensor, which fails when the
gradients are DTensors on several meshes (expert parallelism's experts beside the other
parameters) or DTensors and plain tensors (tensor parallelism without a data-parallel
wrapper). For those parameters the call goes to :func:`parallel.clip.clip_grad_norm_`
(each mesh's norm reduced over its mesh, plain gradients counted once); every other call
is torch's own, unchanged. This is the one place torch's function is replaced; it reads
the process's state and is inert before ``init``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from modelparallel.parallel import clip

if TYPE_CHECKING:
    from modelparallel.smp.state import State

_original = torch.nn.utils.clip_grad.clip_grad_norm_


def install(state: State) -> None:
    """Route ``torch.nn.utils.clip_grad_norm_`` as the module doc says (idempotent)."""

    @functools.wraps(_original)
    def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if state.context_or_none() is None or not clip.mixes_meshes(params):
            return _original(params, max_norm, norm_type, error_if_nonfinite, foreach)
        return clip.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)

    # the name scripts call, and the module's own (its deprecated clip_grad_norm calls it)
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_
