"""Moving a model whose parts may live on another rank (meta tensors) to this device."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def is_meta(t: torch.Tensor) -> bool:
    """A placeholder for a tensor another rank holds (meta, possibly inside a DTensor)."""
    return (t.to_local() if isinstance(t, DTensor) else t).device.type == "meta"


def to_device(module: nn.Module, device: torch.device) -> None:
    """Move ``module``'s real tensors to ``device`` in place (``Module.to`` fails on meta
    tensors); Parameter objects stay the same, so optimizers and ties keep them."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if not is_meta(t) and not isinstance(t, DTensor) and t.device != device:
                t.data = t.data.to(device)
