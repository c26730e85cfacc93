"""What checkpoints need from a model or optimizer wrapper, and nothing more.

The SMP facade's ``DistributedModel`` and ``DistributedOptimizer`` implement these;
checkpoints never reach into a wrapper's attributes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn


@runtime_checkable
class PartitionedModel(Protocol):
    """A model wrapper whose rank may hold only its pipeline stages' part of ``module``."""

    module: nn.Module  # the user's model, parameters under their own names

    @property
    def partitioned(self) -> bool:
        """Whether this rank knows which part it holds (the split has happened)."""
        ...

    @property
    def pipeline_degree(self) -> int:
        """Pipeline ranks the model is split over (1: every rank holds all of it)."""
        ...

    def pipeline_group(self) -> dist.ProcessGroup:
        """The process group of this rank's pipeline."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The whole model (every stage's parameters), on every rank, on CPU."""
        ...

    def load_after_partition(self, load: Callable[[], None]) -> None:
        """Call ``load`` once the split has happened (now, if it has)."""
        ...


@runtime_checkable
class WrappedOptimizer(Protocol):
    """An optimizer wrapper over a torch optimizer."""

    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer, over exactly the parameters this rank holds."""
        ...
