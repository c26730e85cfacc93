"""``mp.save_checkpoint`` / ``mp.resume_from_checkpoint``: resumable training checkpoints.

A checkpoint is the directory ``PATH/TAG``:

- ``checkpoint.json``: what it is (tag, step, sharded or full, layout, time);
- ``sharded/``: model and optimizer as DCP shards (``partial=True``), or
  ``model.safetensors`` (+ ``config.json`` for Hugging Face models) and
  ``optimizer.safetensors`` (``partial=False``);
- ``state.pt``: user content, LR scheduler, data loader position, optimizer settings;
- ``rng/rank<N>.pt``: each rank's random number generators.

It is written as ``PATH/.tmp-TAG-...``, renamed to ``PATH/TAG`` once every rank has
finished, and only then named in ``PATH/newest``. ``checkpoint.json``, written last,
lists every file with its size: a checkpoint whose files changed since is damaged and
never resumed from (``tags.py``). A crash at any point leaves the previous checkpoints
as they were; a save that fails (a full disk) removes what it wrote, and directories
left by a killed save are removed by the next save. Everything is read back without
unpickling arbitrary objects.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
from torch import nn

from modelparallel.checkpoint import full, guard, states
from modelparallel.checkpoint import user_content as user_content_codec
from modelparallel.checkpoint.dcp import (
    discard,
    on_coordinator,
    replace_directory,
    run_dcp,
    temporary_name,
)
from modelparallel.checkpoint.storage import (
    CheckpointError,
    Location,
    SafeLoadPlanner,
    reader_for,
    writer_for,
)
from modelparallel.checkpoint.tags import (
    MANIFEST,
    NEWEST,
    committed_tags,
    intact_tags,
    newest,
    read_manifest,
)
from modelparallel.context import ParallelContext

logger = logging.getLogger("modelparallel")

SHARDED = "sharded"
SMALL_STATE = "state.pt"
FORMAT = "modelparallel-checkpoint/1"


def save_checkpoint(path: str | os.PathLike, tag: str, partial: bool = True,
                    model: nn.Module | None = None, optimizer: Any = None,
                    user_content: Any = None, num_kept_partial_checkpoints: int | None = None,
                    translate_if_full: bool = True, *, lr_scheduler: Any = None,
                    data_loader: Any = None, step: int | None = None,
                    loss_scaler: Any = None, ctx: ParallelContext) -> None:
    """Save a resumable checkpoint as ``path/tag`` and make it the newest. Collective.

    ``partial=True``: each rank writes what it holds (DCP); loads under any layout.
    ``partial=False``: rank 0 writes the whole model as safetensors (and the optimizer);
    a Hugging Face model's directory loads with ``from_pretrained``. ``model`` (a module
    or a :class:`~modelparallel.checkpoint.protocol.PartitionedModel`) and ``optimizer``
    (a torch optimizer or a ``WrappedOptimizer``) are what is saved; the SMP facade's
    ``mp.save_checkpoint`` defaults them to the ``DistributedModel`` /
    ``DistributedOptimizer``.
    ``user_content`` (tensors, numbers, strings, lists, dicts, NumPy values, Hugging
    Face configs: ``user_content.py``) comes back from
    :func:`resume_from_checkpoint`; so do ``lr_scheduler``, ``data_loader`` (its
    position), ``loss_scaler`` (fp16's :class:`~modelparallel.LossScaler`; default: the
    DistributedOptimizer's) and ``step`` (see :func:`info`).
    ``num_kept_partial_checkpoints`` keeps
    only the newest N checkpoints under ``path``. ``translate_if_full`` is accepted for
    SMP compatibility (names are always the single-device model's).
    """
    _check_tag(tag)
    guard.check_every_rank_calls(f"save_checkpoint({os.fspath(path)!r}, tag={tag!r})", ctx)
    scaler = _scaler(loss_scaler, optimizer)
    module, optim, dm = states.unwrap(model, optimizer)
    small = {"user_content": user_content_codec.encode(user_content), "step": step,
             "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
             "data_loader": _loader_state(data_loader),
             "loss_scaler": scaler.state_dict() if scaler is not None else None}
    small_bytes = states.check_safe("user_content", small)  # fail before writing anything
    location = Location(path)
    def prepare() -> None:
        location.writable()
        _remove_leftovers(location)

    on_coordinator(prepare)
    tmp = temporary_name(tag)
    try:
        manifest = {"format": FORMAT, "tag": tag, "partial": partial, "step": step,
                    "world_size": dist.get_world_size(), "layout": ctx.topology.describe(),
                    "model": module is not None, "optimizer": optim is not None}
        failed = f"writing checkpoint {location.url(tag)} failed"
        rank = dist.get_rank()
        # every rank learns of any rank's failure before the next collective (no hang)
        _agree(_attempt(failed, lambda: location.write_bytes(
            states.check_safe("rng", states.rng_state()), tmp, "rng", f"rank{rank}.pt")))
        problem = None
        if partial:
            sd: dict[str, Any] = {}
            if module is not None:
                sd["model"] = states.model_state(module, dm)
            if module is not None and optim is not None:
                sd["optimizer"] = states.optimizer_state(module, optim)
            run_dcp(torch_dcp.save, sd, storage_writer=writer_for(location.url(tmp, SHARDED)),
                    context=failed)
        else:
            model_sd, optim_sd = full.gather(module, optim, dm) if module is not None else \
                ({}, {})
            if rank == 0 and module is not None:
                def write_full() -> None:
                    nonlocal small_bytes
                    written = full.write(location, tmp, module, model_sd, optim_sd)
                    manifest["tied"] = written["tied"]
                    small["optimizer_values"] = written["optimizer_values"]
                    small_bytes = states.check_safe("optimizer settings", small)
                problem = _attempt(failed, write_full)

        def commit() -> None:
            location.write_bytes(small_bytes, tmp, SMALL_STATE)
            manifest["files"] = location.file_sizes(tmp)  # checked on resume: see tags.py
            manifest["saved_at"] = time.time()
            location.write_json(manifest, tmp, MANIFEST)
            replace_directory(location, tmp, tag)
            location.write_atomically(tag, NEWEST)
            _rotate(location, num_kept_partial_checkpoints, keep=tag)

        _agree(problem)  # every rank's files are written (also a barrier)
        on_coordinator(commit)
    except BaseException:
        discard(location, tmp)  # a failed save (a full disk) must not keep its space
        raise
    if rank == 0:
        logger.info("checkpoint %s saved (%s)", location.url(tag),
                    "sharded" if partial else "full")


def resume_from_checkpoint(path: str | os.PathLike, tag: str | None = None,
                           partial: bool = True, strict: bool = True,
                           load_optimizer: bool = True, *, model: nn.Module | None = None,
                           optimizer: Any = None, lr_scheduler: Any = None,
                           data_loader: Any = None, loss_scaler: Any = None,
                           ctx: ParallelContext, **_smp_options: Any) -> Any:
    """Load ``path/tag`` (default: the newest) and return its ``user_content``. Collective.

    A sharded checkpoint loads under any layout (world size, sharding, tensor and
    pipeline parallelism): each rank reads the pieces it now holds. A model that has not
    been split yet (a ``PartitionedModel``) and its optimizer are loaded right after the
    split at the first step (as SMP does). Random generators are restored when the world
    size is the same; the fp16 loss scale
    (``loss_scaler``, default: the DistributedOptimizer's) always. ``partial`` is
    accepted for SMP compatibility; the checkpoint itself says how it was saved.
    """
    guard.check_every_rank_calls(f"resume_from_checkpoint({os.fspath(path)!r}, tag={tag!r})",
                                 ctx)
    location = Location(path)
    tag = tag if tag is not None else _newest_tag(path)
    manifest = _manifest(location, tag)
    small = states.load_safe(_read(location, tag, SMALL_STATE))
    scaler = _scaler(loss_scaler, optimizer)
    if not load_optimizer:
        optimizer = None
    module, optim, dm = states.unwrap(model, optimizer)
    if optim is not None and not manifest["optimizer"]:
        raise CheckpointError(f"{location.url(tag)} was saved without an optimizer; pass "
                              f"load_optimizer=False to load only the model")

    def load_model_and_optimizer() -> None:
        module, optim, dm = states.unwrap(model, optimizer)  # after the split: what it holds
        assert module is not None  # checked before
        states.check_loadable(module)  # every rank alike, before any collective
        if manifest["partial"]:
            _load_sharded(location, tag, module, optim, dm, strict)
        else:
            _load_full(location, tag, manifest, small, module, optim, dm, strict)

    if module is not None and manifest["model"]:
        if dm is not None:
            dm.load_after_partition(load_model_and_optimizer)
        else:
            load_model_and_optimizer()
    if lr_scheduler is not None and small["lr_scheduler"] is not None:
        lr_scheduler.load_state_dict(small["lr_scheduler"])
    if data_loader is not None and small["data_loader"] is not None:
        data_loader.load_state_dict(small["data_loader"])
    if scaler is not None and small.get("loss_scaler") is not None:
        scaler.load_state_dict(small["loss_scaler"])
    _restore_rng(location, tag, manifest)
    if dist.get_rank() == 0:
        logger.info("resumed from checkpoint %s (step %s)", location.url(tag), manifest["step"])
    return user_content_codec.decode(small["user_content"])


def info(path: str | os.PathLike, tag: str | None = None) -> dict[str, Any]:
    """What ``path/tag`` (default: the newest) records: tag, step, partial, world_size,
    layout, saved_at."""
    return _manifest(Location(path), tag if tag is not None else _newest_tag(path))


def _newest_tag(path: str | os.PathLike) -> str:
    tag = newest(path, required=True)
    assert tag is not None  # required: a CheckpointError otherwise
    return tag


# -- helpers -------------------------------------------------------------------------
def _check_tag(tag: str) -> None:
    if not isinstance(tag, str) or not tag or "/" in tag or "\\" in tag or \
            tag.startswith(".") or tag == NEWEST:
        raise CheckpointError(f"checkpoint tag {tag!r} must be a non-empty name without '/' "
                              f"that does not start with '.' and is not '{NEWEST}'")


def _loader_state(data_loader) -> Any:
    if data_loader is None:
        return None
    if not hasattr(data_loader, "state_dict"):
        raise CheckpointError(f"data_loader={type(data_loader).__name__} has no state_dict(); "
                              f"use mp.data.DataLoader (which records its position) or a "
                              f"stateful loader such as torchdata's StatefulDataLoader")
    return data_loader.state_dict()


def _remove_leftovers(location: Location) -> None:
    """Temporary directories of saves that never finished (every rank is here now)."""
    for name in location.children():
        if name.startswith((".tmp-", ".old-")):
            location.remove(name)


def _attempt(failed: str, write: Callable[[], None]) -> str | None:
    """Run ``write``; what went wrong (None: nothing), for :func:`_agree`."""
    try:
        write()
    except CheckpointError as e:
        return str(e)
    except Exception as e:
        return f"{failed}: {type(e).__name__}: {e}"
    return None


def _rotate(location: Location, keep_last: int | None, keep: str) -> None:
    if not keep_last:
        return
    tags = committed_tags(location)
    for old in tags[:max(0, len(tags) - keep_last)]:
        if old != keep:
            location.remove(old)


def _read(location: Location, tag: str, name: str) -> bytes:
    try:
        return location.read_bytes(tag, name)
    except FileNotFoundError as e:
        raise CheckpointError(f"{location.url(tag, name)} is missing; the checkpoint is "
                              f"incomplete") from e


def _manifest(location: Location, tag: str) -> dict[str, Any]:
    return read_manifest(location, tag, FORMAT)


def _agree(problem: str | None) -> None:
    """Raise on every rank when any rank found a problem (so none enters a collective)."""
    problems: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    first = next(((r, p) for r, p in enumerate(problems) if p), None)
    if first:
        raise CheckpointError(first[1] if first[0] == dist.get_rank()
                              else f"on rank {first[0]}: {first[1]}")


def _split(dm) -> bool:
    """Whether this rank holds only its pipeline stage's part of the model."""
    return dm is not None and dm.pipeline_degree > 1


def _load_sharded(location: Location, tag: str, module, optim, dm, strict: bool) -> None:
    url = location.url(tag, SHARDED)
    sd: dict[str, Any] = {"model": states.model_state(module, dm)}
    if optim is not None:
        sd["optimizer"] = states.optimizer_state(module, optim)
    problem = None
    try:
        metadata = reader_for(url).read_metadata()
        saved = {k: tuple(m.size) for k, m in metadata.state_dict_metadata.items()
                 if hasattr(m, "size")}
        for part in sd:
            wanted = {f"{part}.{k}": v for k, v in states.global_shapes(sd[part]).items()}
            have = {k: v for k, v in saved.items() if k.startswith(f"{part}.")}
            mismatch = states.describe_mismatch(part, have, wanted, split=_split(dm),
                                                strict=strict or part == "optimizer")
            if mismatch:
                problem = f"checkpoint {location.url(tag)} does not fit: {mismatch}"
                break
    except CheckpointError as e:
        problem = str(e)
    _agree(problem)
    run_dcp(torch_dcp.load, sd, storage_reader=reader_for(url),
            context=f"reading checkpoint {location.url(tag)} failed: its files are truncated "
                    f"or damaged; resume from another tag (complete ones: "
                    f"{[t for t in intact_tags(location) if t != tag] or 'none'})",
            planner=SafeLoadPlanner(allow_partial_load=not strict))
    states.set_model_state(module, sd["model"], strict=strict and dm is None)
    if optim is not None:
        states.set_optimizer_state(module, optim, sd["optimizer"])


def _load_full(location: Location, tag: str, manifest, small, module, optim, dm,
               strict: bool) -> None:
    problem = None
    template = states.model_state(module, dm)
    try:
        model_sd = full.read_model(location, tag, manifest)
        mismatch = states.describe_mismatch("model", states.global_shapes(model_sd),
                                            states.global_shapes(template),
                                            split=_split(dm), strict=strict)
        if mismatch:
            problem = f"checkpoint {location.url(tag)} does not fit: {mismatch}"
        optim_sd = full.read_optimizer(location, tag, small) if optim is not None else None
    except CheckpointError as e:
        problem = str(e)
    _agree(problem)
    template = {k: v for k, v in template.items() if k in model_sd}
    states.set_model_state(module, states.shard_like(template, model_sd, "model"),
                           strict=strict and dm is None)
    if optim is not None and optim_sd is not None:
        states.set_optimizer_state(module, optim, states.shard_like(
            states.optimizer_state(module, optim), optim_sd, "optimizer"))


def _scaler(loss_scaler: Any, optimizer: Any) -> Any:
    """The loss scaler to save or restore: the one given, else a DistributedOptimizer's."""
    return loss_scaler if loss_scaler is not None else getattr(optimizer, "loss_scaler", None)


def _restore_rng(location: Location, tag: str, manifest: dict[str, Any]) -> None:
    rank = dist.get_rank()
    if manifest["world_size"] != dist.get_world_size():
        if rank == 0:
            logger.warning("random generator states not restored: the checkpoint was saved "
                           "by %d ranks, this run has %d", manifest["world_size"],
                           dist.get_world_size())
        return
    states.set_rng_state(states.load_safe(_read(location, tag, f"rng/rank{rank}.pt")))
