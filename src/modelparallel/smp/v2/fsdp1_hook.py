"""The FSDP1 hook: after ``mp.init()``, an unchanged ``FullyShardedDataParallel(model,
...)`` follows the configuration (:mod:`modelparallel.parallel.fsdp1` says how), and
takes SMP v2's ``post_param_init_fn`` (delayed parameter initialization).

This is the one place torch's FSDP1 constructor is replaced; it reads the process's
state (the context of the current ``mp.init()``) and is inert before ``init``.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any

from torch.distributed.fsdp import FullyShardedDataParallel

from modelparallel.parallel import (
    context_parallel,
    expert_parallel,
    fsdp1,
    fsdp1_state,
    fsdp1_torch,
)
from modelparallel.parallel.expert_parallel import wrappers as expert_wrappers

if TYPE_CHECKING:
    from modelparallel.smp.state import State

_original_init = FullyShardedDataParallel.__init__
_constructing: list[Any] = []  # the FSDP1 units being made, outermost first
_signature = inspect.signature(_original_init)


def install(state: State) -> None:
    """Route FSDP1 construction through the policy of ``state``'s context (idempotent)."""

    @functools.wraps(_original_init)
    def init_with_policy(self: FullyShardedDataParallel, module: Any, *args: Any,
                         **kwargs: Any) -> None:
        # SMP v2's FSDP1 argument, which torch's lacks (fsdp1_torch.post_param_init)
        with fsdp1_torch.post_param_init(kwargs.pop("post_param_init_fn", None)):
            ctx = state.context_or_none()
            if ctx is None:
                _original_init(self, module, *args, **kwargs)
                return
            bound = _signature.bind(self, module, *args, **kwargs)
            arguments = {k: v for k, v in bound.arguments.items()
                         if k not in ("self", "module")}
            if not _constructing:  # the root (its auto-wrap makes the inner units)
                context_parallel.require_split(module, ctx, "FullyShardedDataParallel")
                expert_parallel.balance_over_batch(module, ctx)
                # the split experts: FSDP2 units of their own, which FSDP1 leaves alone
                arguments = expert_wrappers.for_fsdp1(module, ctx, arguments)
            _constructing.append(module)
            try:
                fsdp1.construct(self, module, arguments, ctx, _original_init)
            finally:
                _constructing.pop()

    FullyShardedDataParallel.__init__ = init_with_policy  # type: ignore[method-assign]
    fsdp1_state.install()
    fsdp1_torch.install()
