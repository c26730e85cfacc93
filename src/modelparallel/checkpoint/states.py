"""What a resumable checkpoint holds, taken from and given back to the training objects.

Model and optimizer state go through ``torch.distributed.checkpoint.state_dict``, keyed by
the single-device model's parameter names, with the optimizer flattened per parameter
(``state.<name>.<key>``, ``param_groups.<name>.<key>``): those keys mean the same under
every layout, which is what lets DCP reshard between layouts and pipeline splits.
(FSDP1's own sharded state of a tensor-parallel model holds each tp rank's part; here
those entries are DTensors of the whole parameter, see ``fsdp1_state.global_state_dict``.)
"""

from __future__ import annotations

import io
import random
import re
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from modelparallel.checkpoint.protocol import PartitionedModel, WrappedOptimizer
from modelparallel.checkpoint.storage import CheckpointError
from modelparallel.parallel import fsdp1_state
from modelparallel.parallel.placement import is_meta
from modelparallel.parallel.tensor.styles import stored_shapes, unfuse


def unwrap(model: Any, optimizer: Any) -> tuple[nn.Module | None, Any, PartitionedModel | None]:
    """(module to take state from, torch optimizer, the model's partitioned wrapper or
    None)."""
    dm = model if isinstance(model, PartitionedModel) else None
    if isinstance(optimizer, WrappedOptimizer):
        optimizer = optimizer.torch_optimizer()
    if optimizer is not None and model is None:
        raise CheckpointError("an optimizer's state is saved by parameter name: pass the "
                              "model too (model=...)")
    return (dm.module if dm is not None else model), optimizer, dm


def _options(full: bool, strict: bool = True) -> StateDictOptions:
    return StateDictOptions(full_state_dict=full, cpu_offload=full, strict=strict,
                            flatten_optimizer_state_dict=True)


def model_state(module: nn.Module, dm: Any = None, *, full: bool = False) -> dict[str, Any]:
    """The model's state dict: sharded (DTensors, for DCP) or full (on rank 0, CPU).

    Of a pipeline-split DistributedModel, only what this rank holds (other stages'
    parameters are stand-ins without values here: ``placement.is_meta``)."""
    if not full:
        _check_sharded(module)
    sd = get_model_state_dict(module, options=_options(full))
    if not full:
        sd = _by_global_name(module, sd, optimizer=False)
    return {k: v for k, v in sd.items() if not (isinstance(v, torch.Tensor) and is_meta(v))} \
        if dm is not None else sd


def _check_sharded(module: nn.Module) -> None:
    """Raise (on every rank alike, before any collective) when the sharded state of
    ``module`` cannot be keyed by global parameter name."""
    problem = fsdp1_state.checkpoint_problem(module)
    if problem:
        raise CheckpointError(f"cannot checkpoint the sharded state: {problem}")


def check_loadable(module: nn.Module) -> None:
    """Raise (on every rank alike, before any collective) when a checkpoint cannot be
    loaded into ``module``."""
    problem = fsdp1_state.load_problem(module)
    if problem:
        raise CheckpointError(f"cannot load the checkpoint: {problem}")


def _by_global_name(module: nn.Module, sd: dict[str, Any], *,
                    optimizer: bool) -> dict[str, Any]:
    try:
        return fsdp1_state.global_state_dict(module, sd, optimizer=optimizer)
    except fsdp1_state.UnsupportedCheckpoint as e:
        raise CheckpointError(f"cannot checkpoint the sharded state: {e}") from e


def _by_local_part(module: nn.Module, sd: dict[str, Any], *,
                   optimizer: bool) -> dict[str, Any]:
    try:
        return fsdp1_state.local_state_dict(module, sd, optimizer=optimizer)
    except fsdp1_state.UnsupportedCheckpoint as e:
        raise CheckpointError(f"cannot load the sharded state: {e}") from e


def optimizer_state(module: nn.Module, optimizer: Any, *, full: bool = False,
                    every_rank: bool = False) -> dict[str, Any]:
    """The optimizer's flattened state dict: sharded, or full on rank 0 (on every rank of
    this rank's data/tensor-parallel groups with ``every_rank``), on CPU."""
    options = _options(full)
    if not full:
        _check_sharded(module)
        return _fused_in_model_shapes(module, _by_global_name(
            module, get_optimizer_state_dict(module, optimizer, options=options),
            optimizer=True))
    if every_rank:
        options.cpu_offload = False
        sd = get_optimizer_state_dict(module, optimizer, options=options)
        sd = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    else:
        sd = get_optimizer_state_dict(module, optimizer, options=options)
    return _in_model_shapes(module, sd)


def _in_model_shapes(module: nn.Module, sd: dict[str, Any]) -> dict[str, Any]:
    """Full optimizer state in the shapes of the model's state dict: a fused projection
    stored as ``(..., chunks, width)`` (``stored_shapes``) is ``(..., chunks * width)``
    there, and so is its state."""
    stored = stored_shapes(module)
    if not stored:
        return sd
    out = {}
    for key, value in sd.items():
        fqn = next((f for f in stored if key.startswith(f"state.{f}.")), None)
        if fqn is not None and isinstance(value, torch.Tensor) \
                and tuple(value.shape) == tuple(stored[fqn]):
            value = value.reshape(*value.shape[:-2], -1)
        out[key] = value
    return out


def _fused_in_model_shapes(module: nn.Module, sd: dict[str, Any]) -> dict[str, Any]:
    """Sharded optimizer state with fused projections in the model's state-dict shape,
    as their parameters are saved (``FusedColwiseConv1D``): the state is gathered over
    the merged dims and reshaped, so any layout can load it."""
    stored = stored_shapes(module)
    out = {}
    for key, value in sd.items():
        fqn = next((f for f in stored if key.startswith(f"state.{f}.")), None)
        if fqn is not None and isinstance(value, torch.Tensor) \
                and tuple(value.shape) == tuple(stored[fqn]):
            value = unfuse(value, len(stored[fqn]), value.shape[-2] * value.shape[-1])
        out[key] = value
    return out


def _fused_as_stored(module: nn.Module, optimizer: Any, sd: dict[str, Any]) -> dict[str, Any]:
    """The reverse of :func:`_fused_in_model_shapes`: a fused projection's state back in
    its stored shape and placement (this rank's part; no communication)."""
    stored = stored_shapes(module)
    if not stored:
        return sd
    current = get_optimizer_state_dict(module, optimizer, options=_options(False))
    out = dict(sd)
    for key, value in sd.items():
        target = current.get(key)
        if not (isinstance(value, torch.Tensor) and isinstance(target, DTensor)) or \
                tuple(value.shape) == tuple(target.shape) or \
                not any(key.startswith(f"state.{f}.") for f in stored):
            continue
        shaped = value.reshape(target.shape)
        out[key] = shaped.redistribute(target.device_mesh, target.placements) \
            if isinstance(shaped, DTensor) else \
            distribute_tensor(shaped.to(target.device), target.device_mesh, target.placements,
                              src_data_rank=None)
    return out


def set_model_state(module: nn.Module, sd: dict[str, Any], *, full: bool = False,
                    strict: bool = True) -> None:
    if not full:
        sd = _by_local_part(module, sd, optimizer=False)
    set_model_state_dict(module, sd, options=_options(full, strict))


def set_optimizer_state(module: nn.Module, optimizer: Any, sd: dict[str, Any]) -> None:
    sd = _by_local_part(module, _fused_as_stored(module, optimizer, sd), optimizer=True)
    set_optimizer_state_dict(module, optimizer, sd, options=_options(False))


def shard_like(template: dict[str, Any], full: dict[str, Any], what: str) -> dict[str, Any]:
    """``full`` (every tensor whole, on every rank) cut into this rank's parts, as the
    DTensors of ``template`` are placed. No communication: each rank keeps its slice.

    (torch's own full-state loading scatters from rank 0, which desynchronized ranks
    here, and it cannot take the flattened optimizer form that pipeline splits need.)"""
    sd = {}
    for key, value in template.items():
        if key not in full:
            raise CheckpointError(f"the checkpoint's {what} state has no {key!r}")
        saved = full[key]
        if isinstance(value, DTensor):
            saved = distribute_tensor(saved.reshape(value.shape).to(value.device),
                                      value.device_mesh, value.placements, src_data_rank=None)
        elif hasattr(value, "local_shards"):  # a ShardedTensor (FSDP1 without a mesh)
            saved = _fill_shards(value, saved.reshape(value.shape))
        elif isinstance(value, torch.Tensor):
            saved = saved.reshape(value.shape).to(value.device)
        sd[key] = saved
    return sd


def _fill_shards(template: Any, whole: torch.Tensor) -> Any:
    """``template``, a ShardedTensor (FSDP1 makes them as copies), with this rank's
    shards copied from ``whole``."""
    for shard in template.local_shards():
        meta = shard.metadata
        index = tuple(slice(o, o + n) for o, n in zip(meta.shard_offsets, meta.shard_sizes,
                                                       strict=True))
        shard.tensor.copy_(whole[index])
    return template


def global_shapes(sd: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Name -> full shape of every tensor entry (a DTensor's global shape)."""
    return {k: tuple(v.shape) for k, v in sd.items()
            if isinstance(v, torch.Tensor | DTensor)}


def describe_mismatch(what: str, saved: dict[str, tuple], wanted: dict[str, tuple], *,
                      split: bool = False, strict: bool = True, limit: int = 5) -> str | None:
    """The first differences between a checkpoint's and the model's names and shapes.

    ``split``: this rank holds one pipeline stage, so the checkpoint's other names are
    expected. Not ``strict``: names may be missing or extra; shapes must still agree."""
    if split or not strict:
        saved = {k: v for k, v in saved.items() if k in wanted}
    if not strict:
        wanted = {k: v for k, v in wanted.items() if k in saved}
    missing = sorted(set(wanted) - set(saved))
    extra = sorted(set(saved) - set(wanted))
    shapes = sorted(k for k in set(saved) & set(wanted) if tuple(saved[k]) != tuple(wanted[k]))
    if not (missing or extra or shapes):
        return None
    parts = []
    if missing:
        parts.append(f"{len(missing)} name(s) of the {what} are not in the checkpoint: "
                     f"{', '.join(missing[:limit])}{' ...' if len(missing) > limit else ''}")
    if extra:
        parts.append(f"{len(extra)} name(s) in the checkpoint are not in the {what}: "
                     f"{', '.join(extra[:limit])}{' ...' if len(extra) > limit else ''}")
    if shapes:
        parts.append(f"{len(shapes)} shape(s) differ: " + ", ".join(
            f"{k} (checkpoint {list(saved[k])}, {what} {list(wanted[k])})"
            for k in shapes[:limit]))
    return "; ".join(parts)


# -- small state: same on every rank (rank 0 writes it) ------------------------------
def check_safe(name: str, obj: Any) -> bytes:
    """``obj`` serialized so that ``torch.load(weights_only=True)`` can read it back."""
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as e:
        found = re.search(r"(?:Unsupported global: |unsupported )GLOBAL (\S+)", str(e))
        raise CheckpointError(
            f"{name} must be made of tensors, numbers, strings, None, lists, tuples and "
            f"dicts, because checkpoints are loaded without unpickling arbitrary objects; "
            f"it holds {found.group(1) if found else str(e).splitlines()[0]}. Convert "
            f"that to one of those types") from e
    return buffer.getvalue()


def load_safe(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


# -- random number generators: one state per rank -------------------------------------
def rng_state() -> dict[str, Any]:
    """Python's, NumPy's, torch's CPU and (if any) CUDA generators' states (tensor-
    parallel regions draw from generators derived from these: ``parallel/tensor/rng.py``)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = cast(tuple[str, Any, int, int, float],
                                              np.random.get_state())
    state = {"python": {"version": version, "state": torch.tensor(internal), "gauss": gauss},
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                       "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` saved (a checkpoint's ``tensor_parallel`` streams,
    written before regions derived their generators, have nothing left to restore)."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
