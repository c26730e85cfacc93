"""``torch.sagemaker.distributed.fsdp.checkpoint``: SMP's one-call save and load of an
FSDP1 model's sharded checkpoint (model, optimizer, scheduler and extra values), as the
older SMP v2 example scripts call it. SMP deprecated this module in 2.6.1 and removed it
in 2.7.0; here it is built on :mod:`state_dict_saver` / :mod:`state_dict_loader`.

``checkpointing_pg_metadata`` is the scripts' ``(process_group, coordinator_rank,
action_rank)``: the ranks of ``process_group`` save together, only action ranks write
(one replica of each shard), every rank loads. ``None``: the world, rank 0, every rank.
``sharding_strategy`` is the model's own and is not needed (a line says so once).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from torch import nn
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType

from modelparallel.checkpoint.storage import SafeLoadPlanner
from modelparallel.smp.v2.checkpoint import state_dict_loader, state_dict_saver
from modelparallel.smp.v2.checkpoint._common import say_once
from modelparallel.smp.v2.checkpoint.filesystem import DistributedFileSystemReader

logger = logging.getLogger("modelparallel")

EXPORT_KEY_MODEL = "model"
EXPORT_KEY_OPTIMIZER = "optimizer"
EXPORT_KEY_SCHEDULER = "scheduler"
EXPORT_KEY_IDENTITY = "identity"

_DEPRECATED = ("torch.sagemaker.distributed.fsdp.checkpoint is deprecated (SMP 2.6.1, "
               "removed in 2.7.0): use torch.sagemaker.distributed.checkpoint."
               "state_dict_saver / state_dict_loader")


def _layout(state_dict_type: StateDictType, sharding_strategy: Any, metadata: Any,
            model: nn.Module) -> tuple[Any, int, bool]:
    warnings.warn(_DEPRECATED, DeprecationWarning, stacklevel=3)
    if state_dict_type != StateDictType.SHARDED_STATE_DICT:
        raise NotImplementedError(f"{state_dict_type}: modelparallel's fsdp.checkpoint saves "
                                  f"and loads SHARDED_STATE_DICT only; use state_dict_saver "
                                  f"with sm_state_dict_type for the other types")
    if not FSDP.fsdp_modules(model):
        raise TypeError("fsdp.checkpoint needs an FSDP1 (FullyShardedDataParallel) model")
    if sharding_strategy is not None:
        say_once("fsdp.checkpoint-sharding_strategy", "fsdp.checkpoint: sharding_strategy has "
                 "no effect: the model's own sharding decides what each rank holds")
    if metadata is None:
        return None, 0, True
    process_group, coordinator_rank, action_rank = metadata
    return process_group, coordinator_rank, bool(action_rank)


def save_model_checkpoint(model: nn.Module, state_dict_type: StateDictType, save_dir: str,
                          sharding_strategy: Any = None, checkpointing_pg_metadata: Any = None,
                          log: bool = False, optimizer: Any = None, scheduler: Any = None,
                          extra_exports: dict[str, Any] | None = None) -> None:
    """Save ``model`` (FSDP1, sharded), ``optimizer``, ``scheduler`` and the values of
    ``extra_exports`` to ``save_dir`` (collective over the model's ranks)."""
    group, coordinator, action = _layout(state_dict_type, sharding_strategy,
                                         checkpointing_pg_metadata, model)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state: dict[str, Any] = {EXPORT_KEY_MODEL: model.state_dict()}
        if optimizer is not None:  # collective over the model's group: every rank
            state[EXPORT_KEY_OPTIMIZER] = FSDP.optim_state_dict(model, optimizer)
    if scheduler is not None:
        state[EXPORT_KEY_SCHEDULER] = scheduler.state_dict()
    state.update(extra_exports or {})
    if action:
        state_dict_saver.save(state, checkpoint_id=save_dir, process_group=group,
                              coordinator_rank=coordinator)
    if log:
        logger.info("fsdp.checkpoint: saved %s", save_dir)


def load_model_checkpoint(model: nn.Module, state_dict_type: StateDictType, checkpoint_dir: str,
                          sharding_strategy: Any = None, checkpointing_pg_metadata: Any = None,
                          log: bool = False, optimizer: Any = None, scheduler: Any = None,
                          extra_imports: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load what :func:`save_model_checkpoint` saved into ``model``, ``optimizer`` and
    ``scheduler`` (collective). Returns ``{EXPORT_KEY_MODEL: model, EXPORT_KEY_OPTIMIZER:
    optimizer, EXPORT_KEY_SCHEDULER: scheduler, EXPORT_KEY_IDENTITY: {key: loaded value
    for each key of extra_imports}}`` (``extra_imports`` gives the keys and the values'
    types)."""
    group, coordinator, _ = _layout(state_dict_type, sharding_strategy,
                                    checkpointing_pg_metadata, model)
    extra = dict(extra_imports or {})
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state: dict[str, Any] = {EXPORT_KEY_MODEL: model.state_dict(), **extra}
        if scheduler is not None:
            state[EXPORT_KEY_SCHEDULER] = scheduler.state_dict()
        state_dict_loader.load(state, checkpoint_id=checkpoint_dir, process_group=group,
                               coordinator_rank=coordinator)
        model.load_state_dict(state[EXPORT_KEY_MODEL])
        if optimizer is not None:
            loaded = load_sharded_optimizer_state_dict(
                model_state_dict=state[EXPORT_KEY_MODEL], optimizer_key=EXPORT_KEY_OPTIMIZER,
                storage_reader=DistributedFileSystemReader(checkpoint_dir),
                planner=SafeLoadPlanner())
            optimizer.load_state_dict(FSDP.optim_state_dict_to_load(
                model, optimizer, loaded[EXPORT_KEY_OPTIMIZER]))
    if scheduler is not None:
        scheduler.load_state_dict(state[EXPORT_KEY_SCHEDULER])
    if log:
        logger.info("fsdp.checkpoint: loaded %s", checkpoint_dir)
    return {EXPORT_KEY_MODEL: model, EXPORT_KEY_OPTIMIZER: optimizer,
            EXPORT_KEY_SCHEDULER: scheduler, EXPORT_KEY_IDENTITY: {k: state[k] for k in extra}}


__all__ = ["EXPORT_KEY_IDENTITY", "EXPORT_KEY_MODEL", "EXPORT_KEY_OPTIMIZER",
           "EXPORT_KEY_SCHEDULER", "load_model_checkpoint", "save_model_checkpoint"]
