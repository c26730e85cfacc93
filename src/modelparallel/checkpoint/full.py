"""Consolidated ("full") checkpoints: one set of files written by rank 0.

``model.safetensors`` holds the single-device model's weights (a Hugging Face model's
directory also gets its ``config.json``, so ``from_pretrained`` loads it);
``optimizer.safetensors`` holds the optimizer's tensors, flattened per parameter, and
its other values go with the small state. Reading uses safetensors, never pickle.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from modelparallel.checkpoint import states
from modelparallel.checkpoint.storage import CheckpointError, Location

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"


def gather(module, optimizer, dm) -> tuple[dict[str, Any], dict[str, Any]]:
    """Full model and (flattened) optimizer state on rank 0; ``{}`` elsewhere."""
    if dm is None or not dm.partitioned or dm.pipeline_degree == 1:
        model = states.model_state(module, dm, full=True)
        optim = states.optimizer_state(module, optimizer, full=True) if optimizer else {}
        return model, optim
    # pipeline: each stage gathers its part over its data/tensor-parallel ranks, then the
    # stages' parts meet on rank 0
    model = dm.state_dict()
    optim = {}
    if optimizer is not None:
        part = states.optimizer_state(module, optimizer, full=True, every_rank=True)
        parts: list[Any] = [None] * dm.pipeline_degree
        dist.all_gather_object(parts, part, group=dm.pipeline_group())
        for p in parts:
            optim.update(p)
    if dist.get_rank() != 0:
        return {}, {}
    return model, optim


def write(location: Location, directory: str, module, model_sd: dict[str, Any],
          optim_sd: dict[str, Any]) -> dict[str, Any]:
    """Write the files (rank 0); returns what the manifest records about them."""
    tensors, tied = _without_shared_storage(model_sd)
    location.write_bytes(save_safetensors({k: v.contiguous() for k, v in tensors.items()}),
                         directory, MODEL_FILE)
    config: Any = getattr(module, "config", None)
    if hasattr(config, "to_json_string"):  # Hugging Face: from_pretrained(directory) works
        location.write_bytes(config.to_json_string().encode(), directory, "config.json")
    optim_tensors = {k: v.contiguous() for k, v in optim_sd.items()
                     if isinstance(v, torch.Tensor)}
    if optim_sd:
        location.write_bytes(save_safetensors(optim_tensors), directory, OPTIMIZER_FILE)
    return {"tied": tied,
            "optimizer_values": {k: v for k, v in optim_sd.items() if k not in optim_tensors}}


def read_model(location: Location, directory: str, info: dict[str, Any]) -> dict[str, Any]:
    sd = _read(location, directory, MODEL_FILE)
    for dropped, kept in info.get("tied", {}).items():
        sd[dropped] = sd[kept]
    return sd


def read_optimizer(location: Location, directory: str, info: dict[str, Any]) -> dict[str, Any]:
    if not location.exists(directory, OPTIMIZER_FILE):
        raise CheckpointError(f"{location.url(directory)} has no optimizer state (it was "
                              f"saved without an optimizer); pass load_optimizer=False")
    sd = _read(location, directory, OPTIMIZER_FILE)
    sd.update(info.get("optimizer_values", {}))
    return sd


def _read(location: Location, directory: str, name: str) -> dict[str, torch.Tensor]:
    try:
        return load_safetensors(location.read_bytes(directory, name))
    except FileNotFoundError as e:
        raise CheckpointError(f"{location.url(directory, name)} is missing; the checkpoint "
                              f"is incomplete") from e
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise CheckpointError(f"{location.url(directory, name)} is truncated or damaged: "
                              f"{e}") from e


def _without_shared_storage(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor],
                                                         dict[str, str]]:
    """safetensors refuses tensors that share memory (tied weights): keep the first name
    of each, and remember the others."""
    kept: dict[tuple, str] = {}
    out, tied = {}, {}
    for name, t in sd.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               t.dtype) if t.numel() else None
        if key is not None and key in kept:
            tied[name] = kept[key]
            continue
        if key is not None:
            kept[key] = name
        out[name] = t
    return out, tied
