"""Full (consolidated) state dicts of a model split by any mix of TP and data parallelism."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from modelparallel.parallel.tensor.styles import stored_shapes


def full_state_dict(model: nn.Module, *, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of ``model``, unsplit, under the names of the single-device model.

    Works through FSDP2, FSDP1 and DDP wrappers and tensor-parallel DTensors; a
    Hugging Face model's dict loads back into the untransformed model with
    ``load_state_dict`` (or ``save_pretrained``/``from_pretrained``). Collective: call
    it on every rank. With ``cpu_offload`` (the default) the tensors are gathered to
    CPU on rank 0 only and the other ranks get ``{}``; ``cpu_offload=False`` gives
    every rank the whole dict on its device.
    """
    return cast(dict[str, torch.Tensor], get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)))


def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor],
                         *, strict: bool = True) -> None:
    """Load a full (single-device) state dict into a split model: each rank keeps its
    shards. Every rank passes the same full dict. Collective: call it on every rank."""
    stored: dict[str, Any] = dict(state_dict)
    for name, shape in stored_shapes(model).items():  # fused projections: view as stored
        if name in stored:
            stored[name] = stored[name].reshape(shape)
    set_model_state_dict(model, stored,
                         options=StateDictOptions(full_state_dict=True, strict=strict))
