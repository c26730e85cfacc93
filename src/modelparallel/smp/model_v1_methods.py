"""SMP v1's ``DistributedModel`` methods about what this rank holds and what tensor
parallelism split, and the DDP hooks it refuses (mixed into ``DistributedModel``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard


def _split_by_tp(t: torch.Tensor) -> bool:
    """Sharded on the ``tp`` dimension (FSDP2 also puts a replicated parameter of a split
    model there, ``Replicate()``)."""
    return isinstance(t, DTensor) and any(
        name == "tp" and isinstance(p, Shard)
        for name, p in zip(t.device_mesh.mesh_dim_names or (), t.placements, strict=True))


class V1ModelMethods:
    """Needs ``self.module`` and ``local_modules()`` (``DistributedModel``)."""

    module: nn.Module
    local_modules: Callable[[], Iterator[nn.Module]]
    _post_step_hooks: list[Callable[[Any, Any], None]]

    def local_named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """The modules of this rank's pipeline stage, by their names in the model."""
        held = {id(m) for m in self.local_modules()}
        for name, module in self.module.named_modules():
            if id(module) in held:
                yield name, module

    def local_named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, module in self.local_named_modules():
            for own, buffer in module.named_buffers(recurse=False):
                yield f"{name}.{own}" if name else own, buffer

    def local_buffers(self) -> Iterator[torch.Tensor]:
        for _, buffer in self.local_named_buffers():
            yield buffer

    def distributed_modules(self) -> Iterator[nn.Module]:
        """The modules whose own parameters tensor parallelism split."""
        for module in self.module.modules():
            if any(_split_by_tp(p) for p in module.parameters(recurse=False)):
                yield module

    def is_distributed_parameter(self, param: torch.Tensor) -> bool:
        """Whether tensor parallelism split ``param`` over the tensor-parallel ranks."""
        return _split_by_tp(param)

    def is_distributed_buffer(self, buffer: torch.Tensor) -> bool:
        return _split_by_tp(buffer)

    def register_post_step_hook(self, hook: Callable[[Any, Any], None]) -> None:
        """``hook(model, optimizer)`` runs once, after the first ``@smp.step`` call."""
        self._post_step_hooks.append(hook)

    def run_post_step_hooks(self, optimizer: Any) -> None:
        hooks, self._post_step_hooks = self._post_step_hooks, []
        for hook in hooks:
            hook(self, optimizer)

    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool = True,
             enable: bool = True) -> Iterator[None]:
        """Refused: uneven inputs across data-parallel ranks are not supported."""
        raise NotImplementedError(
            "DistributedModel.join() (uneven inputs) is not supported by modelparallel: "
            "give every data-parallel rank the same number of batches (mp.data's "
            "DataLoader with drop_last=True does)")
        yield  # unreachable; makes this a generator

    def register_comm_hook(self, state: Any, hook: Callable[..., Any]) -> None:
        """Refused: modelparallel reduces the gradients itself, not through DDP."""
        raise NotImplementedError(
            "DistributedModel.register_comm_hook() is not supported by modelparallel: its "
            "gradients are reduced over the data-parallel group by the pipeline engine, "
            "not by a DDP module; compress or reduce gradients after backward instead")
