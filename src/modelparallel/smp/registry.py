"""The DistributedModel and DistributedOptimizer of the current ``mp.init()``.

SMP scripts create one of each and then call ``@smp.step`` functions and checkpoint
functions that find them; a new ``mp.init()`` (or ``mp.reset()``) forgets them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modelparallel.smp.state import state

if TYPE_CHECKING:
    from modelparallel.smp.v1.distributed_model import DistributedModel
    from modelparallel.smp.v1.distributed_optimizer import DistributedOptimizer


def model() -> DistributedModel | None:
    return state.objects.get("model")


def set_model(model: DistributedModel) -> None:
    state.objects["model"] = model


def optimizer() -> DistributedOptimizer | None:
    return state.objects.get("optimizer")


def set_optimizer(optimizer: DistributedOptimizer) -> None:
    state.objects["optimizer"] = optimizer
