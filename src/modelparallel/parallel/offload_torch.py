"""torch's activation wrappers, the one place this package reaches into them.

SMP v2 scripts checkpoint with ``checkpoint_wrapper`` and offload with
``offload_wrapper``, both from the private module
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``; SMP replaces what
``offload_wrapper`` does when ``sm_activation_offloading`` is on. Here: the two wrapper
classes (to recognise checkpointed layers and offload roots) and the switch of
``OffloadWrapper.forward``. ``tests/unit/test_activation_offloader.py``
(``test_torch_wrapper_internals_we_rely_on``) fails if torch changes what this relies on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as _wrappers

CheckpointWrapper = _wrappers.CheckpointWrapper
OffloadWrapper = _wrappers.OffloadWrapper
# torch's own forward: the wrapped module under torch.autograd.graph.save_on_cpu
TORCH_OFFLOAD_FORWARD: Callable[..., Any] = _wrappers.OffloadWrapper.forward


def wrapped_module(wrapper: Any) -> Any:
    """The module an ``OffloadWrapper`` / ``CheckpointWrapper`` wraps."""
    return wrapper._checkpoint_wrapped_module


def set_offload_wrapper_forward(forward: Callable[..., Any] | None) -> None:
    """Make every ``OffloadWrapper`` (made before or after this call) run ``forward(self,
    *args, **kwargs)``; ``None`` gives it torch's own forward back. The class attribute
    is replaced, so scripts that imported ``offload_wrapper`` earlier are covered; the
    installed torch is not changed."""
    OffloadWrapper.forward = forward or TORCH_OFFLOAD_FORWARD  # type: ignore[method-assign]
